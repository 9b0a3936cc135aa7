#!/usr/bin/env bash
# Build the artifact-evaluation image (build_tools/Dockerfile): PyTorch v2.13.0 with the patch series,
# then dynn-runtime on it. Run from anywhere; the build context is the repository root.
#
#   build_tools/docker_build.sh                      # image dynn-ae, MAX_JOBS = cores, arch 8.0;9.0
#   MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 IMAGE=dynn-ae:h100 build_tools/docker_build.sh
#   build_tools/docker_build.sh --check-only         # the apply-only anchor check in a throwaway container
#
# Then (docs/artifact-evaluation.md): docker run --gpus all --rm IMAGE make gpu-check
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-dynn-ae}"
MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}"
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
TARGET=runtime
if [[ "${1:-}" == "--check-only" ]]; then
    TARGET=check
    shift
fi

if ! command -v docker >/dev/null 2>&1; then
    echo "docker_build.sh: expected docker on PATH, found none. Install Docker and the NVIDIA container" >&2
    echo "toolkit, or build without Docker (docs/artifact-evaluation.md, 'Without Docker')." >&2
    exit 2
fi
if ! docker info >/dev/null 2>&1; then
    echo "docker_build.sh: docker is installed but the daemon does not answer (docker info failed)." >&2
    echo "Start it (systemctl start docker) or add your user to the docker group." >&2
    exit 2
fi

echo "building ${IMAGE} (target ${TARGET}, MAX_JOBS=${MAX_JOBS}, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST})"
exec docker build -f "${ROOT}/build_tools/Dockerfile" --target "${TARGET}" -t "${IMAGE}" \
    --build-arg MAX_JOBS="${MAX_JOBS}" --build-arg TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    "$@" "${ROOT}"
