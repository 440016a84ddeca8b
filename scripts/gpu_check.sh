#!/usr/bin/env bash
# Check furlong against a real SGLang and a real vLLM on a machine with an NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [--dry-run] [--engines "sglang vllm"] [--model DIR] [--work DIR]
#
# For each engine: a virtualenv (WORK/venv-ENGINE) with the engine and furlong (the engine's own torch,
# not furlong's CPU pin), then `python -m scripts.engine_check`: start, generate, logprobs vs the trainer,
# weight update (and its measured pause), LoRA load, 2 RL steps through `furlong train train.engine=ENGINE`.
# Then `python -m scripts.fsdp2_check`: 2 FSDP2 trainer steps on one GPU (nccl, bf16 over fp32 masters),
# and `python -m scripts.train_check`: `furlong train` with the trainer and engine on the GPU (direct and
# delta weight sync), and a colocated Ray run (one trainer actor, one engine actor, sharing the GPU) on a
# local cluster the run starts and on one started first that it joins.
# One PASS/FAIL line per check; exit 1 if any failed. The public checkpoint (Qwen/Qwen3-0.6B) is downloaded
# once into WORK/model unless --model names a local one. Sandboxes need install.sh's Debian packages: it
# runs first (as root it installs them; as a user it says what is missing).
#
# --dry-run needs no GPU and no network: the tiny model, this machine's python, and the SGLang checks run
# against tests/sglang_standin.py, a stand-in server (SGLang cannot be installed without a GPU); vLLM
# runs if it and furlong.engine.vllm are importable here, else it is skipped.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"  # the checks reuse tests' fixtures (fsdp2_support)

DRY=0
ENGINES="sglang vllm"
MODEL=""
WORK="$ROOT/.gpu-check"
CHECKPOINT="Qwen/Qwen3-0.6B"
FAILED=0

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --engines) ENGINES="$2"; shift ;;
    --model) MODEL="$2"; shift ;;
    --work) WORK="$2"; shift ;;
    -h|--help) usage ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage ;;
  esac
  shift
done
mkdir -p "$WORK"

say() { echo "gpu_check: $*" >&2; }
fail() { echo "FAIL $1: $2"; FAILED=1; }

# furlong's dependencies without torch: the engine brings the CUDA torch it was built against.
furlong_deps() {
  python3 -c 'import tomllib; print("\n".join(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if not d.startswith("torch")))'
}

# make_venv ENGINE -> WORK/venv-ENGINE with furlong (editable, this checkout) and the engine, installed last
# so the engine's own pins (torch, transformers) win.
make_venv() {
  local engine="$1" venv="$WORK/venv-$1" pkg
  case "$engine" in sglang) pkg="sglang[all]" ;; vllm) pkg="vllm" ;; *) return 1 ;; esac
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || { say "python3 -m venv failed (Debian: apt-get install python3-venv)"; return 1; }
  local pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  mapfile -t deps < <(furlong_deps)
  "${pip[@]}" "${deps[@]}" pytest
  "${pip[@]}" --no-deps -e "$ROOT"
  say "installing $pkg into $venv (several minutes)"
  "${pip[@]}" "$pkg"
  "$venv/bin/python" -c "import $engine, furlong.engine.factory"
}

download_model() {
  local python="$1"
  [ -f "$WORK/model/config.json" ] && return 0
  say "downloading $CHECKPOINT into $WORK/model"
  "$python" -c "from huggingface_hub import snapshot_download; snapshot_download(repo_id='$CHECKPOINT', local_dir='$WORK/model')"
}

# run_checks ENGINE PYTHON MODEL [engine_check flags...]
run_checks() {
  local engine="$1" python="$2" model="$3"
  shift 3
  "$python" -m scripts.engine_check --engine "$engine" --model "$model" --work "$WORK/$engine" "$@" \
    2> >(tee "$WORK/$engine.stderr.log" | tail -n 5 >&2) || FAILED=1
}

dry_run() {
  say "dry run: tiny model, no GPU; SGLang checks use tests/sglang_standin.py (a stand-in, not SGLang)"
  [ -n "$MODEL" ] || MODEL="$(python3 -m furlong.cli model init tiny --out "$WORK/tiny")"
  for engine in $ENGINES; do
    case "$engine" in
      sglang) run_checks sglang python3 "$MODEL" --sglang-module tests.sglang_standin --torch-threads 1 ;;
      vllm)
        if python3 -c "import vllm, furlong.engine.vllm" 2>/dev/null; then
          run_checks vllm python3 "$MODEL" --torch-threads 1
        else
          echo "SKIP vllm: vllm or furlong.engine.vllm is not importable here"
        fi ;;
      *) fail "$engine" "unknown engine (expected sglang or vllm)" ;;
    esac
  done
  python3 -m scripts.fsdp2_check --model "$MODEL" --device cpu || FAILED=1
  python3 -m scripts.train_check --model "$MODEL" --device cpu --work "$WORK/train-check" || FAILED=1
}

gpu_run() {
  if ! nvidia-smi -L >/dev/null 2>&1; then
    fail "gpu" "no NVIDIA GPU (nvidia-smi -L failed); use --dry-run to check the rest"
    return
  fi
  say "GPU: $(nvidia-smi -L | head -n 1)"
  bash "$ROOT/install.sh" >&2 || { fail "install.sh" "sandbox prerequisites missing (see above)"; return; }
  local python="" torch_python=""
  for engine in $ENGINES; do
    if ! make_venv "$engine" >&2; then fail "$engine install" "see the pip output above"; continue; fi
    python="$WORK/venv-$engine/bin/python"
    torch_python="$python"  # a CUDA torch (the engine's) for the FSDP2 check
    [ -n "$MODEL" ] || download_model "$python" || { fail "$engine download" "$CHECKPOINT"; continue; }
    # bf16/fp32 both fit; fp32 keeps the logprob comparison with the fp32 trainer meaningful.
    local extra=(--torch-threads 8)
    [ "$engine" = sglang ] && extra+=(--sglang-python "$python" --sglang-arg=--mem-fraction-static --sglang-arg=0.6)
    run_checks "$engine" "$python" "${MODEL:-$WORK/model}" "${extra[@]}"
  done
  if [ -z "$torch_python" ]; then fail "fsdp2" "no engine virtualenv with a CUDA torch was built"; return; fi
  "$torch_python" -m scripts.fsdp2_check --model "${MODEL:-$WORK/model}" --device cuda \
    2> >(tee "$WORK/fsdp2.stderr.log" | tail -n 5 >&2) || FAILED=1
  "$torch_python" -m scripts.train_check --model "${MODEL:-$WORK/model}" --device cuda --work "$WORK/train-check" \
    2> >(tee "$WORK/train.stderr.log" | tail -n 5 >&2) || FAILED=1
}

if [ "$DRY" = 1 ]; then dry_run; else gpu_run; fi
if [ "$FAILED" = 0 ]; then say "all checks passed"; else say "some checks FAILED"; fi
exit "$FAILED"
