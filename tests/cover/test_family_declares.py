"""What the core once kept in tables by family name (the machinery
``--coverage`` traces, the probe case's family data, the path classes the
probe cannot speak for) each family now declares in its ``Family``: these
check that the core reads them from there, so a new family folder needs no
line in the core."""

from __future__ import annotations

from harness import machinery_coverage as mc
from harness import registry
from harness.engine import probe
from harness.paths import Availability, Family, families


def test_machinery_is_what_the_registered_families_declare() -> None:
    declared = {f.name: f.machinery for f in families() if f.machinery}
    assert declared == registry.declared("machinery")
    assert "torch.utils.checkpoint" in declared["checkpoint"]
    assert mc.Machinery.of("checkpoint").files


def test_the_probe_case_carries_the_part_each_family_declares() -> None:
    for cut in (True, False):
        case = probe.probe_case(cut=cut)
        wanted = {f.name for f in families() if f.probe_data(cut) is not None}
        assert wanted and {name for name, _ in case.family} == wanted, cut


class _Plain:
    name = "toy.plain"
    contract = None

    def availability(self) -> Availability:
        return Availability(True, "")


class _OwnDraws(_Plain):
    name = "toy.own"


def test_kinds_leaves_out_the_path_classes_a_family_says_the_probe_cannot_speak_for(monkeypatch) -> None:
    toy = Family("toy", paths=lambda options: [_Plain(), _OwnDraws()], unprobed={"_OwnDraws": "its own draws"})
    monkeypatch.setattr(probe, "families", lambda: [toy])
    monkeypatch.setattr(probe, "_blind", lambda path: frozenset())
    assert [p.name for p in probe.kinds("toy")] == ["toy.plain"]


def test_the_float32_noise_run_is_the_path_a_family_declares() -> None:
    """The core asks the registry for the noise reference; it names no family."""
    import pathlib

    from harness.engine import check
    from harness.paths import families, noise_reference

    assert [f.name for f in families() if f.noise_reference] == ["eager"]
    assert noise_reference().name == "eager.accumulate"
    assert "eager.accumulate" not in pathlib.Path(check.__file__).read_text()
