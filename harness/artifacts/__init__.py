"""What gradfuzz writes: corpus files, findings, repro scripts, the campaign log.

Owns the corpus format with atomic writes (``corpus``), one file per
signature under a lock (``findings``), standalone scripts from typed values
(``repro``: the shared schedule template, and a family's own through its
``Family.scripts``) and the Redis finding log (``campaign``). May import paths (for their ``Repro``), materialize
and case; never the engine, gate or CLI.
"""
