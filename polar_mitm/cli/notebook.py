"""`polar-mitm notebook`: open JupyterLab on the notebooks in notebooks/, reading a given store.

    polar-mitm notebook --db hello.duckdb                      JupyterLab on 127.0.0.1:8888, browser opened
    polar-mitm notebook --db hello.duckdb --no-browser --port 8890 -- --IdentityProvider.token=SECRET
    polar-mitm notebook --db hello.duckdb -- --allow-root        in a container running as root (Jupyter refuses root)

The store's absolute path goes to the notebooks as POLAR_MITM_DB (each notebook's first cell reads it), so a
relative --db names the store as seen from where the command runs. Needs the `notebooks` extra
(`pip install -e '.[notebooks]'`). Arguments after `--` go to JupyterLab unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import polar_mitm

DB_VARIABLE = "POLAR_MITM_DB"
NOTEBOOKS = Path(polar_mitm.__file__).resolve().parent.parent / "notebooks"  # the checkout's notebooks/ folder


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "notebook",
        help="open the notebooks (JupyterLab) on a store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--db", required=True, help="DuckDB store the notebooks read (passed as $POLAR_MITM_DB)")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help=f"folder JupyterLab opens (default {NOTEBOOKS})")
    parser.add_argument("--ip", default="127.0.0.1", help="address JupyterLab listens on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8888, help="JupyterLab's port (default 8888; the next free one if taken)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser (the URL with its token is printed)")
    parser.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="-- then arguments for JupyterLab")
    parser.set_defaults(func=_notebook)


def jupyter_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The JupyterLab command line and environment for these arguments; ValueError says what is wrong."""
    db = Path(args.db).expanduser().absolute()
    if not db.is_file():
        raise ValueError(f"no store at {db} (--db {args.db})")
    folder = args.notebooks.expanduser().absolute()
    if not folder.is_dir():
        raise ValueError(f"no notebooks folder at {folder}: the notebooks are in the notebooks/ folder of a polar-mitm checkout (--notebooks DIR)")
    if importlib.util.find_spec("jupyterlab") is None:
        raise ValueError("JupyterLab is not installed in this environment: pip install -e '.[notebooks]' (in the polar-mitm checkout)")
    extra = args.jupyter_args[1:] if args.jupyter_args[:1] == ["--"] else args.jupyter_args
    command = [
        sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={folder}", f"--ServerApp.ip={args.ip}", f"--ServerApp.port={args.port}",
        *(["--no-browser"] if args.no_browser else []), *extra,
    ]
    return command, {**os.environ, DB_VARIABLE: str(db)}


def _notebook(args: argparse.Namespace) -> int:
    try:
        command, env = jupyter_command(args)
    except ValueError as error:
        print(f"polar-mitm notebook: {error}", file=sys.stderr)
        return 2
    print(f"polar-mitm notebook: {args.notebooks.expanduser().absolute()} on {env[DB_VARIABLE]} (${DB_VARIABLE})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(command[0], command, env)  # JupyterLab takes over the process (Ctrl-C stops it)
