"""The gate a team runs on a torch upgrade.

The run (``run``) is a sequence of phases (``phases``: selfcheck, replay,
fuzz, confirm known, claim new) over one context: the rows it classifies
(``rows``) and what the corpus replay showed of the ledger (``evidence``).
"Known" is causal, settled by re-running a case with the bug's workaround
or fix probe in force (``known``), which a fuzzing session asks too
(``confirm``). Besides: the known-bug ledger (``ledger``) and its check
against its own cases (``audit``), the statuses (``status``), the reports
(``report``), the version table (``versions``) and the canary self-check
(``selfcheck``). May import the engine and everything below it; only the
CLI and the pytest plugin import it.
"""
