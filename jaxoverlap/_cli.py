"""absl's ``app.run`` for the package's command lines, with ``--help`` exiting 0.

absl prints the help of ``--help`` (``--helpshort``, ``--helpfull``, ``-?``)
and then exits with status 1, as it does for a bad flag; a shell or a script
that asks a tool for its help reads that as a failure. Here the help exits 0,
and a bad flag still exits 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import app

# The help flags absl defines (app.define_help_flags), in the spellings absl accepts.
_HELP = {f"{dash}{name}" for dash in ("-", "--")
         for name in ("help", "helpshort", "helpfull", "helpxml", "?")}


def _parse(argv: Sequence[str]) -> list[str]:
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    if e.code == 1 and any(a in _HELP for a in argv[1:]):  # absl printed the help asked for
      raise SystemExit(0) from None
    raise


def run(main: Callable[[list[str]], object]) -> None:
  """``absl.app.run(main)``, but ``--help`` and its kin exit with status 0."""
  app.run(main, flags_parser=_parse)
