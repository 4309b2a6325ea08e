#!/usr/bin/env bash
# Regenerate the Python stubs of tandem/protocol/generation.proto (run from anywhere).
# The generated files are committed; protobuf in pyproject.toml must be >= the runtime version the
# generated _pb2.py checks for (see the ValidateProtobufRuntimeVersion call in it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  tandem/protocol/generation.proto
echo "regenerated tandem/protocol/generation_pb2{,_grpc}.py (+ .pyi)"
