"""Execute the example notebooks on a kernel that runs this Python (the project's virtual env), optionally
overriding their parameters, and save them with their outputs.

    .venv/bin/python examples/execute_notebooks.py                      # both notebooks, outputs saved in place
    .venv/bin/python examples/execute_notebooks.py what_the_cache_kept.ipynb --set MODEL='"/path/to/llava"'

`--set NAME=EXPR` adds `NAME = EXPR` in a cell right after the notebook's cell tagged `parameters`
(as papermill does). The tests run the notebooks through `execute` too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("chat_with_image.ipynb", "what_the_cache_kept.ipynb")
KERNEL_NAME = "mm-oval-python"


def _kernel_manager(kernel_dir: Path) -> Any:
    """A kernel manager whose only kernel runs `sys.executable` (not whatever `python3` kernel the user
    has installed elsewhere)."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = kernel_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mm-oval (this Python)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


def inject_parameters(nb: Any, parameters: dict[str, str]) -> None:
    """Add `NAME = EXPR` lines in a new cell after the cell tagged `parameters`."""
    import nbformat

    if not parameters:
        return
    idx = next(
        (i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None
    )
    if idx is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    source = "\n".join(f"{k} = {v}" for k, v in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(idx + 1, cell)


def execute(
    path: str | Path,
    parameters: dict[str, str] | None = None,
    out: str | Path | None = None,
    timeout: int = 600,
) -> Any:
    """Run every cell of the notebook at `path` (raises `nbclient.exceptions.CellExecutionError` on the first
    error) and return it with its outputs; write it to `out` when given (atomically)."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, parameters or {})
    with tempfile.TemporaryDirectory() as kernels:
        client = NotebookClient(
            nb,
            km=_kernel_manager(Path(kernels)),
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    if out is not None:
        out = Path(out)
        tmp = out.with_name(out.name + ".tmp")
        nbformat.write(nb, tmp)
        os.replace(tmp, out)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", help=f"default: {' '.join(NOTEBOOKS)}")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=EXPR", help="override a parameter"
    )
    parser.add_argument(
        "--out-dir", default=None, help="write the executed notebooks here (default: in place)"
    )
    args = parser.parse_args(argv)
    params = {}
    for item in args.set:
        name, eq, expr = item.partition("=")
        if not eq:
            parser.error(f"--set {item!r}: write NAME=EXPR")
        params[name.strip()] = expr
    for name in args.notebooks or NOTEBOOKS:
        src = Path(name) if Path(name).exists() else HERE / name
        dest = Path(args.out_dir) / src.name if args.out_dir else src
        dest.parent.mkdir(parents=True, exist_ok=True)
        execute(src, params, out=dest)
        print(f"executed {src} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
