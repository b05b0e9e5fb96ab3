"""Tools for looking at what was recorded: prompt diffs between turns (`diff`) and text tables (`tables`).
Library code: the CLI (`polar-mitm diff`, `polar-mitm sql`), the demo and the notebooks import it."""
