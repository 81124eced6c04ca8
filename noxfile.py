"""The gate against several torch versions, side by side.

    nox -s gate            # one session per torch version below, each in its own venv
    nox -s table           # one table: rows are ledger bugs and new findings, columns versions

    nox -s stack           # one session per release of each training stack below
    gradfuzz versions CASE --package deepspeed   # where CASE starts and stops diverging over those releases

Each ``gate`` session writes ``reports/gate-<torch>.json``; a report from
elsewhere (a GPU machine, an older CI run) dropped into ``reports/`` joins the
table too. Edit TORCH to choose versions; ``nox -s "gate(torch='2.14.1')"``
runs one.
"""

import glob

import nox

TORCH = ["2.11.0", "2.13.0", "2.14.1"]
# Releases of each training stack, oldest first: older ones included, so a
# bug's range has a start. ``gradfuzz versions`` reads this list (nox -l --json).
STACKS = {
    "deepspeed": ["0.14.5", "0.15.4", *(f"0.16.{i}" for i in range(10)), *(f"0.17.{i}" for i in range(7)),
                  *(f"0.18.{i}" for i in range(10)), *(f"0.19.{i}" for i in range(9))],
    "megatron-core": ["0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1"],
    "torchtitan": ["0.2.0", "0.2.2", "0.3.0"],
}
FAMILY = {"deepspeed": "deepspeed", "megatron-core": "megatron", "torchtitan": "torchtitan"}
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("torch", TORCH)
def gate(session: nox.Session, torch: str) -> None:
    session.install(f"torch=={torch}")
    session.install("-e", ".[test]")
    session.run("gradfuzz", "gate", "--minutes", "1", "--save", f"reports/found-{torch}",
                "--json", f"reports/gate-{torch}.json", "--markdown", f"reports/gate-{torch}.md",
                success_codes=[0, 1])


@nox.session(venv_params=["--system-site-packages"])
@nox.parametrize("package,release", [(p, r) for p, rs in STACKS.items() for r in rs])
def stack(session: nox.Session, package: str, release: str) -> None:
    """One release of one stack over the torch already installed (the venv
    sees the system's packages: torch is not downloaded again). Without
    arguments it runs the stack family's gate; with them, ``python ARGS``
    (what ``gradfuzz versions`` runs in each release)."""
    session.install("--no-deps", "-e", ".")
    session.install(f"{package}=={release}")
    if session.posargs:
        session.run("python", *session.posargs)
        return
    session.run("python", "-m", "harness", "gate", "--paths", FAMILY[package], "--examples", "20",
                "--json", f"reports/gate-{package}-{release}.json", success_codes=[0, 1])


@nox.session(python=False)
def table(session: nox.Session) -> None:
    session.run("gradfuzz", "table", *sorted(glob.glob("reports/gate-*.json")))
