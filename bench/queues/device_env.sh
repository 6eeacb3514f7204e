# Source on the lent H200 from the repository root (`. bench/queues/device_env.sh`), in the call that carries the
# vLLM bundle's last part and the wheel set: installs both where the image does not have them and exports the
# environment every bench and the launcher run in. bench/README.md ("A device session") has the whole sequence.
if [ ! -d /tmp/site/vllm ]; then
  bash .gpu/p3/install-on-device.sh .gpu/p3 || return 3   # assembles the parts staged in /tmp/stage
fi
if [ ! -d /tmp/site-deploy/tyro ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deploy .whl/*.whl || return 3
fi
export PYTHONPATH=/tmp/site:$PWD:/tmp/site-deploy PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
# A Firecracker VM: its MemTotal starts far below the 128 GiB it gives as memory is used (device KINDS.md), so the
# host-memory AdamW's check (runtime/hostmem.py) is told the machine's memory.
export PARALLAX_HOST_MEMORY_GIB=128
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
