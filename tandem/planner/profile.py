"""The profile: what `tandem profile` measured on one machine for one model and engine config, as JSON.

A profile holds four tables (prefill step time vs tokens, whole-prompt time vs chunk budget, decode
step time vs batch and context, KV transfer time vs bytes) plus the identity of what was measured
(the model's config hash, dtype, block size, token budget, seats, threads), so `tandem plan` can
refuse to plan with a profile of another model or config. `CostModel` turns the tables into the
step-time functions the simulator calls. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

PROFILE_VERSION = 1


def model_config_hash(model_dir: str) -> str:
    """sha256 of the checkpoint's config.json, canonicalised (key order and spacing do not count)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the model's config.json at {path}: {exc}") from None
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(slots=True)
class ModelIdentity:
    path: str
    config_hash: str
    num_layers: int
    kv_bytes_per_token: int  # one token's K and V across every layer: what a transfer moves
    max_model_len: int


@dataclass(slots=True)
class EngineSettings:
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_num_batched_tokens: int  # the chunk budget of one step
    max_num_seqs: int  # seats in a continuous batch
    threads: int
    num_kv_blocks: int


@dataclass(slots=True)
class Profile:
    model: ModelIdentity
    engine: EngineSettings
    prefill: list[dict]  # {"tokens", "seconds"}: one step prefilling one fresh prompt of `tokens`
    prefill_chunked: list[dict]  # {"prompt_tokens", "chunk_budget", "seconds"}: a whole prompt, chunked
    decode: list[dict]  # {"batch", "context", "seconds"}: one decode step; a full batch x context grid
    kv_transfer: dict  # {"connector", "points": [{"bytes", "seconds"}]}; connector "none": no points
    machine: dict = field(default_factory=dict)  # informative only: host, cpus, load, date
    version: int = PROFILE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Profile:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"profile {path} is malformed: {exc}") from None

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, this tandem reads version {PROFILE_VERSION}")
        prof = cls(model=ModelIdentity(**data["model"]), engine=EngineSettings(**data["engine"]),
                   prefill=list(data["prefill"]), prefill_chunked=list(data.get("prefill_chunked", [])),
                   decode=list(data["decode"]), kv_transfer=dict(data["kv_transfer"]),
                   machine=dict(data.get("machine", {})))
        prof.validate()
        return prof

    def validate(self) -> None:
        def points(rows: list, keys: tuple[str, ...], what: str) -> None:
            for row in rows:
                if not isinstance(row, dict) or any(not isinstance(row.get(k), (int, float)) for k in keys):
                    raise ValueError(f"every {what} row needs numeric {keys}, got {row!r}")
                if row["seconds"] <= 0:
                    raise ValueError(f"{what} row {row!r}: seconds must be > 0")

        points(self.prefill, ("tokens", "seconds"), "prefill")
        points(self.prefill_chunked, ("prompt_tokens", "chunk_budget", "seconds"), "prefill_chunked")
        points(self.decode, ("batch", "context", "seconds"), "decode")
        if len({r["tokens"] for r in self.prefill}) < 2:
            raise ValueError("prefill needs at least two distinct token counts")
        batches = sorted({r["batch"] for r in self.decode})
        contexts = sorted({r["context"] for r in self.decode})
        if len(self.decode) != len(batches) * len(contexts) or not self.decode:
            raise ValueError("decode must be a full grid: one row per (batch, context) pair")
        if self.kv_transfer.get("connector") != "none":
            points(self.kv_transfer.get("points", []), ("bytes", "seconds"), "kv_transfer")
            if len({p["bytes"] for p in self.kv_transfer.get("points", [])}) < 2:
                raise ValueError("kv_transfer needs at least two distinct sizes (or connector 'none')")

    def check_matches(self, model_dir: str | None = None, **engine: Any) -> None:
        """ValueError when the profile was measured for another model or engine setting than asked."""
        if model_dir is not None:
            want = model_config_hash(model_dir)
            if want != self.model.config_hash:
                raise ValueError(f"the profile is of another model (config hash {self.model.config_hash}, "
                                 f"from {self.model.path}); {model_dir} has {want}: run `tandem profile` for it")
        for name, value in engine.items():
            if value is not None and getattr(self.engine, name) != value:
                raise ValueError(f"the profile was measured with {name}={getattr(self.engine, name)}, not {value}: "
                                 f"run `tandem profile` with that setting")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended linearly past both ends."""
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostModel:
    """Step times from a profile. Prefill step: g(tokens) + alpha * sum(chunk x earlier context) (the
    attention to earlier chunks, fitted on the chunked rows). Decode step: bilinear in (batch, mean
    context), the context held inside the measured range. A mixed step (colocated chunked prefill
    beside decodes) pays the decode step plus the prefill tokens' marginal cost g(n) - g(0).
    Transfer: a least-squares line in bytes."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        rows = sorted((r["tokens"], r["seconds"]) for r in profile.prefill)
        self._px, self._py = [float(x) for x, _ in rows], [float(y) for _, y in rows]
        self.g0 = max(0.0, _interp(self._px, self._py, 0.0))  # fixed cost of a step (weights, launch)
        self.alpha = self._fit_alpha(profile)
        self._batches = sorted({float(r["batch"]) for r in profile.decode})
        self._contexts = sorted({float(r["context"]) for r in profile.decode})
        grid = {(float(r["batch"]), float(r["context"])): float(r["seconds"]) for r in profile.decode}
        self._grid = [[grid[(b, c)] for c in self._contexts] for b in self._batches]
        self.xfer_t0, self.xfer_per_byte = self._fit_transfer(profile)
        self.kv_bytes_per_token = profile.model.kv_bytes_per_token
        self.num_layers = profile.model.num_layers
        self.budget = profile.engine.max_num_batched_tokens
        self.seats = profile.engine.max_num_seqs

    def g(self, tokens: float) -> float:
        return max(_interp(self._px, self._py, tokens), 1e-6)

    def _fit_alpha(self, profile: Profile) -> float:
        num = den = 0.0
        for r in profile.prefill_chunked:
            base, attn = chunk_cost(int(r["prompt_tokens"]), int(r["chunk_budget"]), self.g)
            num += (r["seconds"] - base) * attn
            den += attn * attn
        return max(0.0, num / den) if den else 0.0

    @staticmethod
    def _fit_transfer(profile: Profile) -> tuple[float, float]:
        pts = profile.kv_transfer.get("points", [])
        if profile.kv_transfer.get("connector") == "none" or not pts:
            return 0.0, 0.0
        xs, ys = [float(p["bytes"]) for p in pts], [float(p["seconds"]) for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return max(my - slope * mx, 0.0), slope

    def prefill_step(self, tokens: int, attn: float) -> float:
        """One step prefilling `tokens` prompt tokens; attn = sum over chunks of chunk x earlier context."""
        return self.g(tokens) + self.alpha * attn

    def decode_step(self, batch: int, context: float) -> float:
        bs, cs, grid = self._batches, self._contexts, self._grid
        # Held inside the measured contexts: extending a noisy slope past them can even go negative.
        context = min(max(context, cs[0]), cs[-1])
        if len(bs) == 1:
            return max(_interp(cs, grid[0], context) if len(cs) > 1 else grid[0][0], 1e-6)
        i = min(max(bisect.bisect_right(bs, batch), 1), len(bs) - 1)
        if len(cs) > 1:
            lo, hi = _interp(cs, grid[i - 1], context), _interp(cs, grid[i], context)
        else:
            lo, hi = grid[i - 1][0], grid[i][0]
        return max(lo + (hi - lo) * (batch - bs[i - 1]) / (bs[i] - bs[i - 1]), 1e-6)

    def mixed_step(self, batch: int, context: float, prefill_tokens: int, attn: float) -> float:
        if batch == 0:
            return self.prefill_step(prefill_tokens, attn)
        step = self.decode_step(batch, context)
        if prefill_tokens:
            step += self.g(prefill_tokens) - self.g0 + self.alpha * attn
        return step

    def transfer(self, prompt_tokens: int) -> float:
        """Seconds to move a prompt's KV (every layer), start to acknowledgement."""
        if self.xfer_per_byte == 0.0 and self.xfer_t0 == 0.0:
            return 0.0
        return self.xfer_t0 + self.xfer_per_byte * prompt_tokens * self.kv_bytes_per_token


def chunk_cost(prompt: int, budget: int, g: Any) -> tuple[float, float]:
    """(sum of g over a prompt's chunks, sum of chunk x earlier context) when prefilled alone."""
    base = attn = 0.0
    done = 0
    while done < prompt:
        n = min(budget, prompt - done)
        base += g(n)
        attn += n * done
        done += n
    return base, attn
