# Sourced by bench/gpu.sh and bench/gpu-run.sh: what farm needs on a GPU machine.
#
#   source bench/gpu-env.sh && farm_gpu_env ROOT
#
# Installs the carried wheels of bench/wheels/ (pyzmq, msgspec, supervisor: the GPU machine
# has no package registry) into a temporary folder when Python lacks them, and puts that
# folder and ROOT (this repository) on PYTHONPATH. Uses $PYTHON (default python3).

farm_gpu_env() {
    local root=$1 python=${PYTHON:-python3}
    local wheels=$root/bench/wheels site
    if ! "$python" -c 'import zmq, msgspec, supervisor' 2>/dev/null; then
        if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
            echo "bench: pyzmq, msgspec or supervisor is missing and $wheels holds no" \
                 "wheels: run bench/gpu.sh --download where pip reaches PyPI" >&2
            return 2
        fi
        site=$(mktemp -d /tmp/farm-gpu-site.XXXXXX)
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$site" "$wheels"/*.whl || return 2
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
}
