"""The P:D simulator against closed forms, the planner's picks on constructed profiles, workloads, and
`tandem plan` end to end (its table, --min-workers-for-rate, --emit-kustomize and its bad input)."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main as cli_main
from tandem.planner.planner import Slo, Split, best, min_workers, plan, simulate
from tandem.planner.profile import CostModel, EngineSettings, ModelIdentity, Profile, chunk_cost
from tandem.planner.simulator import Simulator
from tandem.planner.workload import Workload, load, read_trace, synthetic

G0, G1 = 0.001, 0.0001  # prefill step: g(n) = G0 + G1 * n


def make_profile(decode=lambda b, c: 0.01, budget: int = 2048, seats: int = 64, xfer_per_byte: float = 0.0,
                 alpha: float = 0.0, g=(G0, G1), kv_bytes_per_token: int = 1000, layers: int = 6) -> Profile:
    def pre(n: int) -> float:
        return g[0] + g[1] * n

    chunked = []
    if alpha:  # one chunked row whose time is exactly the model's: CostModel must recover alpha
        base, attn = chunk_cost(1000, 100, pre)
        chunked = [{"prompt_tokens": 1000, "chunk_budget": 100, "seconds": base + alpha * attn}]
    xfer = ({"connector": "zmq", "points": [{"bytes": b, "seconds": b * xfer_per_byte} for b in (1e4, 1e6)]}
            if xfer_per_byte else {"connector": "none", "points": []})
    prof = Profile(ModelIdentity("/m", "abc", layers, kv_bytes_per_token, 4096),
                   EngineSettings("float32", "float32", 16, budget, seats, 1, 10_000),
                   prefill=[{"tokens": n, "seconds": pre(n)} for n in (16, 2048)], prefill_chunked=chunked,
                   decode=[{"batch": b, "context": c, "seconds": decode(b, c)} for b in (1, 2, 64) for c in (16, 4096)],
                   kv_transfer=xfer)
    prof.validate()
    return prof


def run(prof: Profile, rows: list[tuple[float, int, int]], p: int = 1, d: int = 1, colocated: bool = False):
    wl = Workload([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], "test")
    return Simulator(CostModel(prof), 0 if colocated else p, d, colocated).run(wl)


def test_one_request_disaggregated_ttft_is_the_prefill_and_itl_the_step():
    res = run(make_profile(), [(0.0, 100, 5)])
    assert res.ttft_s[0] == pytest.approx(G0 + G1 * 100)
    assert res.itl_s[0] == pytest.approx(0.01)


def test_chunked_prefill_pays_every_chunk_and_the_fitted_attention_term():
    prof = make_profile(budget=64, alpha=2e-7)
    cost = CostModel(prof)
    assert cost.alpha == pytest.approx(2e-7)
    res = run(prof, [(0.0, 150, 2)])
    chunks = 3 * G0 + G1 * 150
    assert res.ttft_s[0] == pytest.approx(chunks + 2e-7 * (64 * 64 + 22 * 128))


def test_fcfs_queue_at_one_prefill_worker():
    # Arrivals every 5 ms, 11 ms of prefill each, one prompt per step: request k waits for k before it.
    res = run(make_profile(budget=100), [(0.005 * k, 100, 1) for k in range(20)])
    for k, ttft in enumerate(res.ttft_s):
        assert ttft == pytest.approx(0.011 * (k + 1) - 0.005 * k)


def test_conditional_disaggregation_keeps_short_prompts_on_d_while_p_is_busy():
    # As the router does (--local-prefill-if-busy 150): B (100 tokens) arrives while P computes A, so D
    # prefills it at once, as a colocated worker would; C (200 tokens) arrives then too, but is P's.
    wl = Workload([0.0, 0.005, 0.006], [100, 100, 200], [1, 1, 1], "test")
    pure = Simulator(CostModel(make_profile()), 1, 1, False).run(wl)
    sim = Simulator(CostModel(make_profile()), 1, 1, False, local_if_busy=150)
    res = sim.run(wl)
    assert sim.p_of == [0, -1, 0]
    alone_on_d = run(make_profile(), [(0.0, 100, 1)], d=1, colocated=True).ttft_s[0]
    assert res.ttft_s[1] == pytest.approx(alone_on_d) and pure.ttft_s[1] == pytest.approx(0.011 + G0 + G1 * 300 - 0.005)
    assert alone_on_d < pure.ttft_s[1]
    # the price: A's KV (at 11 ms) waits for the end of D's step that prefills B
    assert pure.ttft_s[0] == pytest.approx(0.011) and res.ttft_s[0] == pytest.approx(0.005 + alone_on_d)
    # C reaches P only when D's step ends (D seats requests, and asks P, at step boundaries): at 16 ms
    assert res.ttft_s[2] == pytest.approx(0.005 + alone_on_d + G0 + G1 * 200 - 0.006)
    assert res.ttft_s[2] < pure.ttft_s[2]


def test_kv_that_arrives_mid_step_joins_at_the_next_step_boundary():
    prof = make_profile(decode=lambda b, c: 0.01 * b)
    res = run(prof, [(0.0, 100, 11), (0.034, 100, 3)])
    # A: first token 0.011, five 10 ms steps alone, two 20 ms steps beside B, three alone again.
    assert res.ttft_s[0] == pytest.approx(0.011)
    assert res.itl_s[0] == pytest.approx((0.131 - 0.011) / 10)
    # B: D seats it (and asks P) at its step boundary 0.041; the KV lands at 0.052, inside the step
    # ending 0.061, where B's first token goes out; then two steps of 20 ms.
    assert res.ttft_s[1] == pytest.approx(0.061 - 0.034)
    assert res.itl_s[1] == pytest.approx(0.02)


def test_colocated_prefill_chunk_rides_in_a_decode_step():
    res = run(make_profile(), [(0.0, 100, 11), (0.034, 50, 2)], d=1, colocated=True)
    assert res.ttft_s[0] == pytest.approx(0.011)
    # B is seated at A's step boundary 0.041; that step costs decode + g(50) - g(0) = 0.015.
    assert res.ttft_s[1] == pytest.approx(0.041 + 0.01 + G1 * 50 - 0.034)
    assert res.itl_s[1] == pytest.approx(0.01)


def test_workers_sharing_a_core_share_its_speed():
    """Two colocated workers pinned to one core (tandem up with more workers than cores): the core is
    processor-shared, so while both are busy each runs at half speed; on cores of their own, nothing changes."""
    wl = Workload([0.0, 0.0], [100, 100], [5, 5], "test")
    alone = Simulator(CostModel(make_profile()), 0, 2, True).run(wl)
    assert alone.ttft_s == pytest.approx([0.011, 0.011]) and alone.itl_s == pytest.approx([0.01, 0.01])
    own = Simulator(CostModel(make_profile()), 0, 2, True, core_of=[0, 1]).run(wl)
    assert own.ttft_s == alone.ttft_s and own.itl_s == alone.itl_s
    shared = Simulator(CostModel(make_profile()), 0, 2, True, core_of=[0, 0]).run(wl)
    # both 11 ms prefills run side by side at half speed (22 ms), then every 10 ms decode step too
    assert shared.ttft_s == pytest.approx([0.022, 0.022]) and shared.itl_s == pytest.approx([0.02, 0.02])
    # worker 0 leaves after one shared step (at 0.042): worker 1's other nine steps run at full speed
    wl = Workload([0.0, 0.0], [100, 100], [2, 11], "test")
    shared = Simulator(CostModel(make_profile()), 0, 2, True, core_of=[0, 0]).run(wl)
    assert shared.ttft_s == pytest.approx([0.022, 0.022])
    assert shared.itl_s == pytest.approx([0.02, (0.042 + 0.09 - 0.022) / 10])
    # a prefill worker re-timed mid-step: P's 11 ms prefill (from 0) shares the core with D's work
    # from 5 ms on (D's own 6 ms prefill of a short prompt): P ends at 0.005 + 2 * 0.006 = 0.017
    wl = Workload([0.0, 0.005], [100, 50], [1, 1], "test")
    sim = Simulator(CostModel(make_profile()), 1, 1, False, local_prefill_threshold=80, core_of=[0, 0])
    shared = sim.run(wl)
    assert shared.ttft_s[1] == pytest.approx(0.012)  # D's 6 ms at half speed
    assert shared.ttft_s[0] == pytest.approx(0.017)
    with pytest.raises(ValueError, match="core_of names 1 workers"):
        Simulator(CostModel(make_profile()), 0, 2, True, core_of=[0])


def test_transfer_overlaps_all_but_the_last_layer():
    prof = make_profile(xfer_per_byte=1e-7)  # 100 tokens x 1000 B = 1e5 B: 10 ms
    res = run(prof, [(0.0, 100, 2)])
    prefill = G0 + G1 * 100
    exposed = max(0.01 / 6, 0.01 - prefill * 5 / 6)
    assert res.ttft_s[0] == pytest.approx(prefill + exposed)


def test_short_prompts_are_prefilled_on_decode_and_seats_bound_the_batch():
    res = run(make_profile(seats=1), [(0.0, 10, 3), (0.0, 10, 3)])
    # Below the local-prefill threshold (32): D prefills; one seat: the second waits for the first.
    first_done = G0 + G1 * 10 + 2 * 0.01
    assert res.ttft_s == pytest.approx([G0 + G1 * 10, first_done + G0 + G1 * 10])


def test_simulates_hundreds_of_workers_and_1e5_requests_quickly():
    wl = synthetic("balanced", 100_000, rate=300.0, seed=1)
    out = simulate(CostModel(make_profile(decode=lambda b, c: 0.005 + 0.0004 * b + 2e-6 * b * c)),
                   Split(100, 200), wl, Slo(1.0, 0.05))
    assert out.attainment > 0.99  # well under capacity
    assert out.sim_wall_s < 60


# ---- the planner ---------------------------------------------------------------------------------

def test_prompt_heavy_with_costly_prefill_picks_the_most_prefill_workers():
    # 0.1 s per 500-token prompt: one P serves 10 req/s; decode is nearly free. At 25 req/s only 3P keep
    # up; colocated workers keep up too, but every prefill stalls their decodes past the ITL target.
    prof = make_profile(decode=lambda b, c: 0.001, g=(0.0, 0.0002))
    wl = synthetic("prompt=500,output=10", 3000, rate=25.0, seed=2)
    outcomes = plan(CostModel(prof), wl, Slo(ttft_s=1.0, itl_s=0.01), workers=4)
    assert [str(o.split) for o in outcomes] == ["1P:3D", "2P:2D", "3P:1D", "colocated x4"]
    assert str(best(outcomes).split) == "3P:1D"
    assert best(outcomes).attainment > 0.9


def test_decode_bound_with_cheap_prefill_picks_colocated():
    # Each decode worker holds ~18 streams within the 20 ms ITL target (4.5 req/s of 200 tokens):
    # 3 decoders fall short of 15 req/s, 4 colocated workers do not; their prefills take 7 ms.
    prof = make_profile(decode=lambda b, c: 0.002 + 0.001 * b, seats=18)
    wl = synthetic("prompt=64,output=200", 3000, rate=15.0, seed=3)
    outcomes = plan(CostModel(prof), wl, Slo(ttft_s=2.0, itl_s=0.02), workers=4)
    assert best(outcomes).split == Split(0, 4, colocated=True)
    assert {str(o.split): o.attainment for o in outcomes}["1P:3D"] < 0.5


def test_min_workers_for_rate_is_the_smallest_that_keeps_up():
    # Colocated, 0.1 s per request of pure prefill work: N workers serve 10 N req/s.
    prof = make_profile(decode=lambda b, c: 0.001, g=(0.0, 0.0002))
    wl = synthetic("prompt=500,output=2", 4000, rate=35.0, seed=4, process="uniform")
    n, outcome = min_workers(CostModel(prof), wl, Slo(ttft_s=0.5, itl_s=1.0), max_workers=64)
    assert n == 4
    assert outcome.attainment >= 0.9


# ---- workloads -----------------------------------------------------------------------------------

def test_poisson_arrivals_have_the_asked_rate_and_lengths_their_range():
    wl = synthetic("prompt=uniform:10:20,output=exp:50", 20_000, rate=8.0, seed=5)
    assert wl.rate == pytest.approx(8.0, rel=0.03)
    assert min(wl.prompt_tokens) == 10 and max(wl.prompt_tokens) == 20
    assert sum(wl.output_tokens) / len(wl) == pytest.approx(50, rel=0.05)


def test_trace_replays_its_own_times_or_is_retimed(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": t, "prompt_tokens": 10 + t, "output_tokens": 3}) + "\n"
                            for t in range(5)))
    wl = load(str(path), 0, None)
    assert wl.arrival_s == [0, 1, 2, 3, 4] and wl.prompt_tokens == [10, 11, 12, 13, 14]
    re = load(str(path), 100, 50.0)
    assert len(re) == 100 and re.prompt_tokens[:6] == [10, 11, 12, 13, 14, 10] and re.duration_s < 10


@pytest.mark.parametrize("text, message", [
    ("", "has no requests"),
    ('{"arrival_s": 0, "prompt_tokens": 3}\n', "line 1"),
    ('{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 1}\n{"arrival_s": 0, "prompt_tokens": 3, '
     '"output_tokens": 1}\n', "goes back in time"),
    ("not json\n", "line 1"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}\n', "integers >= 1"),
])
def test_bad_traces_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace(str(path))


# ---- `tandem plan` -------------------------------------------------------------------------------

@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    make_profile(decode=lambda b, c: 0.001, g=(0.0, 0.0002)).save(str(path))
    return str(path)


def plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_every_split_marks_the_best_and_writes_kustomize(profile_file, tmp_path, capsys):
    code, stdout, stderr = plan_cli(
        capsys, "--profile", profile_file, "--workload", "prompt=500,output=10", "--rate", "25",
        "--ttft-slo", "1", "--itl-slo", "0.01", "--workers", "4", "--requests", "2000",
        "--emit-kustomize", str(tmp_path / "k"))
    assert code == 0, stderr
    rows = [line for line in stdout.splitlines() if "P:" in line or "colocated" in line]
    assert [r.split()[1] if r.startswith("*") else r.split()[0] for r in rows[:4]] == ["1P:3D", "2P:2D", "3P:1D",
                                                                                        "colocated"]
    assert [r for r in rows if r.startswith("*")][0].split()[1] == "3P:1D"
    patch = (tmp_path / "k" / "tandem-pd-replicas.yaml").read_text()
    assert "name: tandem-prefill\nspec:\n  replicas: 3" in patch
    assert "name: tandem-decode\nspec:\n  replicas: 1" in patch
    assert "tandem-pd-replicas.yaml" in (tmp_path / "k" / "kustomization.yaml").read_text()


def test_plan_min_workers_for_rate(profile_file, capsys):
    code, stdout, stderr = plan_cli(
        capsys, "--profile", profile_file, "--workload", "prompt=500,output=2", "--rate", "35",
        "--ttft-slo", "0.5", "--itl-slo", "1", "--min-workers-for-rate", "--requests", "2000",
        "--arrivals", "uniform")
    assert code == 0, stderr
    assert "smallest cluster: 4 workers" in stdout


@pytest.mark.parametrize("extra, message", [
    (["--workload", "prompt=500"], "bad workload"),
    (["--workload", "prompt=uniform:9:3,output=3"], "A <= B"),
    (["--ttft-slo", "0.001"], "no split of 4 workers meets"),
    (["--model", "TANDEM_DEFAULT"], "another model"),
    (["--profile", "/nonexistent/p.json"], "cannot read profile"),
    (["--workers", "0"], "--workers must be >= 1"),
])
def test_plan_bad_input_exits_2_with_one_line(profile_file, extra, message, capsys):
    from tandem.default_model import default_model_path

    extra = [default_model_path() if e == "TANDEM_DEFAULT" else e for e in extra]
    args = {"--profile": profile_file, "--workload": "prompt=500,output=10", "--rate": "25", "--ttft-slo": "1",
            "--itl-slo": "0.01", "--workers": "4", "--requests": "500"}
    for i in range(0, len(extra), 2):
        args[extra[i]] = extra[i + 1]
    code = cli_main(["plan", *[x for kv in args.items() for x in kv]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0], err


def test_plan_refuses_an_empty_trace(profile_file, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code = cli_main(["plan", "--profile", profile_file, "--workload", str(empty), "--ttft-slo", "1",
                     "--itl-slo", "1", "--workers", "2"])
    assert code == 2 and "has no requests" in capsys.readouterr().err
