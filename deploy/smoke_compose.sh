#!/usr/bin/env bash
# Smoke test of deploy/docker-compose.yml: bring up router + prefill + decode, wait for the router's
# /health to count both workers, send one greedy /v1/completions and one /v1/chat/completions
# request, check each is 200 with non-empty text, that the prefill worker computed the (long)
# completion prompt (so the KV crossed containers), and that every service's healthcheck passes;
# print the timings, and always take it all down.
#
#   deploy/smoke_compose.sh                       # the image: scripts/build_image.sh (tandem:latest)
#   TANDEM_COMPOSE="docker compose" deploy/smoke_compose.sh
#
# The compose tool: $TANDEM_COMPOSE, else podman-compose, else `docker compose`, else docker-compose.
# It runs as its own project (tandem-smoke) on free host ports with a fresh TANDEM_LINK_SECRET, so
# it touches no other deployment. The last line is machine-readable: `smoke-compose-result {json}`.
# Exit codes: 0 served; 3 no compose tool or no image; anything else: the smoke test failed.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PROJECT=${TANDEM_SMOKE_PROJECT:-tandem-smoke}
export TANDEM_IMAGE=${TANDEM_IMAGE:-tandem:latest}
HEALTH_TIMEOUT_S=${TANDEM_SMOKE_TIMEOUT:-300}

say() { echo "smoke_compose: $*" >&2; }

if [ -n "${TANDEM_COMPOSE:-}" ]; then read -r -a compose <<<"$TANDEM_COMPOSE"
elif command -v podman-compose >/dev/null 2>&1; then compose=(podman-compose)
elif command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then compose=(docker-compose)
else say "no compose tool (podman-compose, docker compose or docker-compose)"; exit 3
fi
engine=docker
[ "$(basename "${compose[0]}")" = podman-compose ] && engine=podman
if ! "$engine" image inspect "$TANDEM_IMAGE" >/dev/null 2>&1; then
  say "no image $TANDEM_IMAGE: build it first with scripts/build_image.sh"; exit 3
fi

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export TANDEM_HTTP_PORT=${TANDEM_HTTP_PORT:-$(free_port)}
export TANDEM_GRPC_PORT=${TANDEM_GRPC_PORT:-$(free_port)}
TANDEM_LINK_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export TANDEM_LINK_SECRET
dc() { "${compose[@]}" -p "$PROJECT" -f "$HERE/docker-compose.yml" "$@"; }
log=$(mktemp -t tandem-smoke.XXXXXX)

down() {
  local rc=$?
  if [ "$rc" != 0 ]; then
    say "failed (exit $rc); compose output and the services' last log lines:"
    tail -30 "$log" >&2 || true
    for service in router prefill decode; do
      echo "--- $service" >&2
      dc logs --tail 30 "$service" >&2 2>&1 || true
    done
  fi
  t_down=$SECONDS
  dc down -t 40 >>"$log" 2>&1 || true
  # podman-compose 1.0 leaves the network it made; docker compose removes its own.
  [ "$engine" = podman ] && podman network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
  say "down in $((SECONDS - t_down)) s"
  rm -f "$log"
  exit "$rc"
}
trap down EXIT
trap 'exit 130' INT TERM

dc down -t 5 >"$log" 2>&1 || true   # a previous run's leftovers, if it was killed
say "up: ${compose[*]} -p $PROJECT, image $TANDEM_IMAGE, http :$TANDEM_HTTP_PORT"
t0=$(date +%s.%N)
dc up -d >>"$log" 2>&1

# The client side: /health, then the requests; writes their result as JSON to $out.
out=$(mktemp -t tandem-smoke-result.XXXXXX)
python3 - "$TANDEM_HTTP_PORT" "$HEALTH_TIMEOUT_S" "$t0" >"$out" <<'EOF'
import json, sys, time, urllib.error, urllib.request

port, timeout, t0 = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
base = f"http://127.0.0.1:{port}"

def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read()), time.monotonic() - start

health, deadline = {}, time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        health = call("/health")[1]
    except urllib.error.HTTPError as e:  # 503 until a decode worker is live, same JSON
        health = json.loads(e.read() or b"{}")
    except (OSError, ValueError):
        pass
    live = health.get("live_workers") or {}
    if live.get("prefill", 0) >= 1 and live.get("decode", 0) >= 1:
        break
    time.sleep(0.5)
else:
    sys.exit(f"smoke_compose: the router never counted a prefill and a decode worker in {timeout:.0f} s "
             f"(last /health: {health})")
t_health = time.time() - t0
print(f"smoke_compose: /health counts {health['live_workers']} {t_health:.1f} s after up", file=sys.stderr)

model = call("/v1/models")[1]["data"][0]["id"]
# >= 32 prompt tokens (the decode worker --local-prefill-threshold): the prefill worker computes it
prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively with two " \
         "running values so that large n takes linear time and constant memory.\"\"\"\n"
status, out, t_comp = call("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
text = out["choices"][0]["text"]
assert status == 200 and text.strip(), (status, out)
print(f"smoke_compose: completion 200 in {t_comp * 1000:.0f} ms (the first: warm-up included): {text!r}",
      file=sys.stderr)
warm = []
for i in range(3):  # new prompts (no prefix-cache hit), each through the prefill worker again
    status, again, took = call("/v1/completions", {"model": model, "prompt": f"# variant {i}\n" + prompt,
                                                   "max_tokens": 8, "temperature": 0})
    assert status == 200 and again["choices"][0]["text"].strip(), (status, again)
    warm.append(took)
t_warm = sorted(warm)[1]
print(f"smoke_compose: 3 more completions, median {t_warm * 1000:.0f} ms", file=sys.stderr)
status, out, t_chat = call("/v1/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "Say hello."}]})
reply = out["choices"][0]["message"]["content"]
assert status == 200 and reply.strip(), (status, out)
print(f"smoke_compose: chat 200 in {t_chat * 1000:.0f} ms: {reply!r}", file=sys.stderr)
print(json.dumps({
    "model": model, "health_s": round(t_health, 2), "completion_ms": round(t_comp * 1000, 1),
    "completion_warm_ms": round(t_warm * 1000, 1),
    "chat_ms": round(t_chat * 1000, 1), "completion": text, "chat": reply,
    "live_workers": health["live_workers"]}))
EOF
result=$(cat "$out"); rm -f "$out"

# Each service's container: compose v1/v2 and podman-compose all set these labels.
container() {
  "$engine" ps -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" | head -1
}
# The prefill worker's own counter, read from the router's container: it also shows that containers
# reach each other by service name (podman: netavark + aardvark-dns; see deploy/README.md).
prefills=$("$engine" exec "$(container router)" python -c 'import re, urllib.request as u
text = u.urlopen("http://prefill:9100/metrics", timeout=5).read().decode()
print(sum(float(v) for v in re.findall(r"^tandem_prefill_requests_total\{[^}]*result=\"done\"[^}]*\} (\S+)", text, re.M)))')
say "the prefill worker computed ${prefills} prompt(s)"
python3 -c 'import sys; sys.exit(float(sys.argv[1]) < 4)' "$prefills" || { say "the prefill worker computed nothing"; exit 1; }

# Healthchecks: podman runs them from systemd timers, which a host without systemd lacks, so ask
# podman to run each now; docker runs them itself, so wait for its verdict.
for service in router prefill decode; do
  id=$(container "$service")
  if [ "$engine" = podman ]; then
    podman healthcheck run "$id" >/dev/null || { say "$service: healthcheck failed"; exit 1; }
  else
    for _ in $(seq 60); do
      state=$(docker inspect --format '{{.State.Health.Status}}' "$id")
      [ "$state" = healthy ] && break
      sleep 1
    done
    [ "$state" = healthy ] || { say "$service: healthcheck $state"; exit 1; }
  fi
done
say "healthchecks pass: router prefill decode"
echo "smoke-compose-result $(python3 -c 'import json, sys; r = json.loads(sys.argv[1]); r["prefills"] = float(sys.argv[2]); print(json.dumps(r))' "$result" "$prefills")"
