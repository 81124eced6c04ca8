from harness.cli.main import entry

entry()
