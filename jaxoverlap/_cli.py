"""absl's ``app.run`` for the package's command lines, with ``--help`` exiting 0.

absl prints the help of ``--help`` (``--helpshort``, ``--helpfull``, ``-?``)
and then exits with status 1, as it does for a bad flag; a shell or a script
that asks a tool for its help reads that as a failure. Here the help exits 0,
and a bad flag still exits 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from absl import app, flags


def _parse(argv: Sequence[str]) -> list[str]:
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    # absl exits 1 both ways; a bad flag exits while it handles the flags.Error, the help
    # (--help, --help=true, --helpfull, ... wherever they stand) with nothing being handled.
    if e.code == 1 and not isinstance(e.__context__, flags.Error):
      raise SystemExit(0) from None
    raise


def run(main: Callable[[list[str]], object]) -> None:
  """``absl.app.run(main)``, but ``--help`` and its kin exit with status 0."""
  app.run(main, flags_parser=_parse)
