"""benchmarks.parallel's CPU half: what each parallel mode sends per DiT step is its formula
(``omni_ray.runners.parallel.traffic``), byte for byte, on gangs of spawned gloo processes. Three modes here (a
Ulysses x ring gang with a padded split, tensor x CFG, and a rows-split step); the benchmark runs them all."""

from benchmarks import parallel


def test_the_bytes_each_mode_sends_per_step_are_its_formula(tiny_dir):
    modes = {name: parallel.MODES[name] for name in ("ulysses 2 x ring 2", "tensor 2 x cfg 2",
                                                     "ulysses 2, rows split")}
    report = parallel.cpu_report(str(tiny_dir), steps=2, modes=modes)
    assert len(report["cpu"]) == len(modes) * len(parallel.CPU_SIZES)
    for row in report["cpu"]:
        assert row["measured"] and all(sum(step.values()) > 0 for step in row["measured"]), row
        assert row["equal"], row
