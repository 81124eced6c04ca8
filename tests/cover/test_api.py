import harness


def test_public_api_is_exactly_this():
    assert sorted(harness.__all__) == [
        "Case", "Divergence", "Observation", "Options", "Path", "check", "fuzz", "register_path", "replay", "resolve",
    ]
    for name in harness.__all__:
        assert getattr(harness, name) is not None


def test_register_path_adds_a_third_party_path():
    from harness.paths import all_paths
    from harness.paths.split.paths import SplitPath

    mine = SplitPath("team.split", "oracles.split_fixed", stock_contract=False)
    harness.register_path(mine)
    try:
        assert "team.split" in [p.name for p in all_paths()]
        assert [p.name for p in harness.resolve("team")] == ["team.split"]
    finally:
        from harness import paths

        paths._registered.clear()
