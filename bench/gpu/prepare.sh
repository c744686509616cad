#!/bin/bash
# Build an offline bundle for a GPU host that has CUDA 13 torch and Python 3.12 but no package access:
#   cd <project root> && bash bench/gpu/prepare.sh       -> .gpu/ (about 42 MB, git-ignored through .git/info/exclude)
# It holds: wheels pdserve needs that such a host lacks (flashinfer-python 0.6.17 + apache-tvm-ffi, msgspec,
# pyzmq, fastapi, starlette, uvicorn, pydantic, httptools, xgrammar, gguf for the real model's conversion,
# pytest), NIXL 1.5.1 (the meta wheel and nixl-cu13 trimmed to its UCX/POSIX plugins and the libraries they
# load: 17 MB instead of 59 MB), and bin/ = the bench scripts of bench/gpu/ (run.sh, gen_model.py, ...).
# On the GPU host, from the project root: OUT_DIR=/some/dir bash .gpu/bin/run.sh   (see run.sh)
# REAL=1: also .gpu-real/part-00, part-01 (+ sha256): the default model's GGUF split for step `real`
# (bench/gpu/README.md says how the parts travel).
set -euo pipefail
ROOT=$(pwd); HERE=$(cd "$(dirname "$0")" && pwd); G=$ROOT/.gpu
[[ -f $ROOT/pyproject.toml ]] || { echo "run from the project root" >&2; exit 2; }
ex=$(git rev-parse --git-dir)/info/exclude; mkdir -p "$(dirname "$ex")"; grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >> "$ex"
mkdir -p $G/whl $G/bin; rm -f $G/bin/*; cp $HERE/*.py $HERE/run.sh $G/bin/
PY=${PYTHON:-python3}
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for pkg in apache-tvm-ffi==0.1.15.post2 flashinfer-python==0.6.17 msgspec==0.22.0 pyzmq==27.3.0 fastapi==0.115.12 \
           starlette==0.46.2 uvicorn==0.34.3 pydantic==2.10.6 pydantic-core==2.27.2 annotated-types==0.7.0 httptools==0.9.0 nixl==1.5.1 \
           xgrammar==0.2.8 gguf==${GGUF_VERSION:-0.19.0} pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0; do
  name=${pkg%%==*}; ver=${pkg#*==}
  ls $G/whl/"${name//-/_}"-"$ver"-*.whl > /dev/null 2>&1 && continue  # already here
  $PY -m pip download -q --no-deps $PLAT -d $G/whl "$pkg" 2>&1 | grep -v WARNING || true
done
if [[ ! -f $G/nixl_cu13_trim.zip ]]; then
  t=$(mktemp -d); $PY -m pip download -q --no-deps $PLAT -d $t nixl-cu13==1.5.1 2>&1 | grep -v WARNING || true
  (cd $t && mkdir x && cd x && $PY -m zipfile -e ../nixl_cu13-*.whl . \
   && rm -rf nixl_ep_cu13 nixl_cu13-1.5.1.data nixl_cu13.scripts nixl_cu13.libs/ucx/libucx_perftest* .nixl_cu13.mesonpy.libs/libnixl_test_utils.so \
   && for d in .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl; do for f in $d/*.so; do case $f in *UCX*|*POSIX*) ;; *) rm "$f";; esac; done; done
   # drop bundled libraries that nothing left loads (the object-store and cloud plugins' dependencies)
   for _ in 1 2 3 4 5; do
     needed=$(find . -name '*.so*' -type f -exec readelf -d {} \; 2>/dev/null | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | sort -u); n=0
     for f in nixl_cu13.libs/*.so*; do b=${f##*/}; case $b in libnuma*|libpull*) continue;; esac
       grep -qx "$b" <<< "$needed" || { rm "$f"; n=$((n + 1)); }; done
     ((n == 0)) && break
   done
   $PY -m zipfile -c $G/nixl_cu13_trim.zip $(ls -A))
  rm -rf $t
fi
if [[ ${REAL:-} ]]; then  # the default model's GGUF (98 MB) in two parts, each small enough for one device call
  R=$ROOT/.gpu-real; grep -qx '/.gpu-real/' "$ex" || echo '/.gpu-real/' >> "$ex"
  gguf=$($PY -c 'from common.model.default_model import find_gguf; print(find_gguf())')
  rm -rf $R; mkdir -p $R; split -b 50M -d "$gguf" $R/part-; sha256sum < "$gguf" | cut -d' ' -f1 > $R/sha256
  ls -l $R
fi
du -sh $G
