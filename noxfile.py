"""The gate against several torch versions, side by side.

    nox -s gate            # one session per torch version below, each in its own venv
    nox -s table           # one table: rows are ledger bugs and new findings, columns versions

Each ``gate`` session writes ``reports/gate-<torch>.json``; a report from
elsewhere (a GPU machine, an older CI run) dropped into ``reports/`` joins the
table too. Edit TORCH to choose versions; ``nox -s "gate(torch='2.14.1')"``
runs one.
"""

import glob

import nox

TORCH = ["2.11.0", "2.13.0", "2.14.1"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("torch", TORCH)
def gate(session: nox.Session, torch: str) -> None:
    session.install(f"torch=={torch}")
    session.install("-e", ".[test]")
    session.run("gradfuzz", "gate", "--minutes", "1", "--save", f"reports/found-{torch}",
                "--json", f"reports/gate-{torch}.json", "--markdown", f"reports/gate-{torch}.md",
                success_codes=[0, 1])


@nox.session(python=False)
def table(session: nox.Session) -> None:
    session.run("gradfuzz", "table", *sorted(glob.glob("reports/gate-*.json")))
