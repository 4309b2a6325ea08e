#!/bin/sh
# tandem's container entrypoint: `tandem "$@"`, plus what a compose file cannot say per replica.
#
# A worker binds 0.0.0.0 inside its container, so it must tell the router an address the router can
# reach, and a name of its own. With `docker compose up --scale decode=N` every replica needs its
# own of both, so a worker service sets TANDEM_WORKER_PORT (the port of its --listen) and we add
#   --advertise tcp://<this container's IP>:<port> --worker-id <role>-<container hostname>
set -e
if [ -n "${TANDEM_WORKER_PORT:-}" ]; then
  ip=$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
  set -- "$@" --advertise "tcp://${ip}:${TANDEM_WORKER_PORT}" --worker-id "$1-$(hostname)"
fi
exec tandem "$@"
