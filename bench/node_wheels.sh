#!/usr/bin/env bash
# The wheels that install SGLang 0.5.17 offline on the lent GPU machine (../shared/notes/sglang-on-h200.md), in two
# parts that each fit one call's 64 MiB: bash bench/node_wheels.sh [DIR]  (default .wheels; DIR/part1, DIR/part2).
# The machine has torch 2.11.0, triton, requests and safetensors; these are the rest, at SGLang 0.5.17's pins.
set -euo pipefail
DIR=${1:-.wheels}
PART1=(flashinfer-python==0.6.15.post1 sglang-kernel==0.4.5 xgrammar==0.2.1 transformers==5.12.1)
PART2=(annotated-types==0.8.0 apache-tvm-ffi==0.1.11 asttokens==3.0.2 cffi==2.1.1 compressed-tensors==0.20.1
       dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1
       ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 jsonschema==4.26.0
       jsonschema-specifications==2025.9.1 loguru==0.7.3 matplotlib-inline==0.2.2 msgspec==0.23.0 openai==2.6.1
       opentelemetry-api==1.45.2 orjson==3.13.0 parso==0.8.7 partial-json-parser==0.2.1.1.post7 pexpect==4.9.0
       prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4
       pydantic_core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1
       setproctitle==1.3.8 sglang==0.5.17 sniffio==1.3.1 soundfile==0.13.1 stack-data==0.6.3 starlette==1.10.0
       tokenizers==0.22.2 traitlets==5.16.1 typing-inspection==0.4.5 uvicorn==0.55.0 wcwidth==0.9.4)
download() {  # download DEST NAME==VER...: cp312 wheels for the machine's glibc
    local dest=$1; shift
    mkdir -p "$dest"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dest" "$@"
}
slim() {  # slim WHEEL PATTERN...: drop members (and their RECORD lines); pip --no-deps installs the rest
    python3 - "$@" <<'PY'
import fnmatch, os, sys, zipfile
wheel, patterns = sys.argv[1], sys.argv[2:]
dropped = lambda name: any(fnmatch.fnmatch(name, p) for p in patterns)
slimmed = wheel + ".slim"
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if dropped(item.filename):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not dropped(line.split(b",", 1)[0].decode()))
        dst.writestr(item, data)
os.replace(slimmed, wheel)
PY
}
one() {  # one GLOB-MATCHES...: the single match (an older wheel left in the folder would be slimmed as a pattern)
    [ $# = 1 ] && [ -f "$1" ] || { echo "expected one wheel, found: $*" >&2; return 1; }
    echo "$1"
}
download "$DIR/part1" "${PART1[@]}"
download "$DIR/part2" "${PART2[@]}"
# FlashAttention-3 (326 MiB; the bench runs --attention-backend triton) and the Blackwell ops (loaded only off sm90)
kernel=$(one "$DIR"/part1/sglang_kernel-*.whl)
xgrammar=$(one "$DIR"/part1/xgrammar-*.whl)
slim "$kernel" 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*'
slim "$xgrammar" 'xgrammar/lib/libxgrammar.a'   # a static library, unused from Python
du -sh "$DIR"/part1 "$DIR"/part2
