"""The gate a team runs on a torch upgrade.

Owns the run (``run``: selfcheck, replay, fuzz, classification), the
known-bug ledger (``ledger``), the reports (``report``), the version table
(``versions``) and the canary self-check (``selfcheck``). May import the
engine and everything below it; only the CLI imports it.
"""
