"""`tandem profile` with the real engine and connector, and the profile's schema checks: what `tandem plan`
relies on (the model's identity, the engine settings, consistent transfer sizes) and what it refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.cli import main as cli_main
from tandem.default_model import default_model_path
from tandem.planner.profile import CostModel, Profile, model_config_hash


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("profile") / "p.json")
    out = tandem("profile", "--quick", "-o", path, "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
    assert out.returncode == 0, out.stderr
    assert "profile [" in out.stderr and "9/9" in out.stderr  # the progress bar ran to the end
    return path


@pytest.mark.slow
def test_quick_profile_records_the_model_and_engine_and_real_times(quick_profile):
    prof = Profile.load(quick_profile)
    assert prof.model.config_hash == model_config_hash(default_model_path())
    assert prof.model.num_layers == 6 and prof.model.max_model_len == 1024
    # One token of K and V in every layer: 6 layers x 2 x 4 KV heads x 32 dims x 4 bytes (float32).
    assert prof.model.kv_bytes_per_token == 6 * 2 * 4 * 32 * 4
    e = prof.engine
    assert (e.dtype, e.block_size, e.max_num_batched_tokens, e.max_num_seqs, e.threads) == ("float32", 16, 256, 8, 1)
    assert {r["batch"] for r in prof.decode} == {1, 4}
    assert prof.kv_transfer["connector"] == "zmq"
    assert [p["bytes"] for p in prof.kv_transfer["points"]] == [16 * prof.model.kv_bytes_per_token,
                                                                64 * prof.model.kv_bytes_per_token]
    assert all(0 < r["seconds"] < 5 for r in prof.prefill + prof.decode + prof.kv_transfer["points"])
    cost = CostModel(prof)
    assert cost.budget == 256 and cost.seats == 8 and cost.transfer(512) > 0


@pytest.mark.slow
def test_plan_takes_the_profile_for_its_model_and_refuses_another(quick_profile, tmp_path):
    from tiny_models import make_checkpoint, write_tokenizer

    common = ["plan", "--profile", quick_profile, "--workload", "prompt=64,output=8", "--rate", "2",
              "--ttft-slo", "5", "--itl-slo", "1", "--workers", "2", "--requests", "200"]
    ok = tandem(*common, "--model", default_model_path(), timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "1P:1D" in ok.stdout and "colocated x2" in ok.stdout
    other = str(tmp_path / "other")
    make_checkpoint(other)
    write_tokenizer(other)
    bad = tandem(*common, "--model", other, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "profile is of another model" in bad.stderr


@pytest.mark.slow
def test_profile_without_a_connector_plans_colocated_and_disaggregated(tmp_path):
    path = str(tmp_path / "p.json")
    out = tandem("profile", "--quick", "--kv-connector", "none", "-o", path)
    assert out.returncode == 0, out.stderr
    prof = Profile.load(path)
    assert prof.kv_transfer == {"connector": "none", "points": []}
    assert CostModel(prof).transfer(1000) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["profile", "--quick", "--threads", "0"], "--threads must be >= 1"),
    (["profile", "--quick", "--model", "/nonexistent/model"], "nonexistent"),
])
def test_profile_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    code = cli_main([*argv, "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def _valid() -> dict:
    return {"version": 1,
            "model": {"path": "/m", "config_hash": "h", "num_layers": 2, "kv_bytes_per_token": 10,
                      "max_model_len": 100},
            "engine": {"dtype": "float32", "kv_cache_dtype": "float32", "block_size": 16,
                       "max_num_batched_tokens": 64, "max_num_seqs": 4, "threads": 1, "num_kv_blocks": 10},
            "prefill": [{"tokens": 1, "seconds": 0.1}, {"tokens": 9, "seconds": 0.2}], "prefill_chunked": [],
            "decode": [{"batch": 1, "context": 1, "seconds": 0.1}],
            "kv_transfer": {"connector": "none", "points": []}}


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=7), "version 7"),
    (lambda d: d["model"].pop("config_hash"), "config_hash"),
    (lambda d: d["prefill"].pop(), "two distinct token counts"),
    (lambda d: d["decode"].append({"batch": 2, "context": 5, "seconds": 0.1}), "full grid"),
    (lambda d: d["decode"][0].update(seconds=0), "seconds must be > 0"),
    (lambda d: d.update(kv_transfer={"connector": "zmq", "points": [{"bytes": 1, "seconds": 1}]}), "two distinct"),
])
def test_malformed_profiles_are_refused_with_the_reason(tmp_path, mutate, message):
    data = _valid()
    Profile.from_dict(json.loads(json.dumps(data)))  # the base is valid
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Profile.load(str(path))


def test_a_profile_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        Profile.load(str(path))


def test_engine_setting_mismatch_is_named():
    prof = Profile.from_dict(_valid())
    with pytest.raises(ValueError, match="block_size=16, not 32"):
        prof.check_matches(block_size=32)


def test_the_decode_grid_fits_the_kv_cache_at_its_largest_batch():
    """With 128 seats (the default) a model's whole max_model_len x batch does not fit every KV pool: the grid's
    longest context is cut to what the largest batch can hold, and every (batch, context) point is measured.
    Without the cut this pool (256 blocks = 4096 tokens, 16 seats, contexts up to ~419) cannot hold the batch."""
    import random

    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.planner.measure import decode_times, make_plan

    engine = LLMEngine(EngineConfig(model=default_model_path(), num_kv_blocks=256, max_model_len=512,
                                    max_num_batched_tokens=256, max_num_seqs=16))
    plan = make_plan(512, 256, 16, False, engine.num_kv_blocks, 16)
    assert make_plan(512, 256, 16, False).contexts[-1] * 16 > 4096  # the uncut grid would not fit
    assert plan.contexts[-1] < 256 and plan.batches[-1] == 16
    rng = random.Random(0)
    for context in (plan.contexts[0], plan.contexts[-1]):
        points = decode_times(engine, context, plan, lambda n: [rng.randrange(5, 500) for _ in range(n)])
        assert [b for b, _ in points] == plan.batches and all(secs > 0 for _, secs in points)
    assert not engine.has_unfinished_requests()
