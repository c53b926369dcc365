# megatron-pipette on NVIDIA's PyTorch container (torch, Transformer Engine, apex and NCCL included).
# Build:  docker build -t megatron-pipette .
# Run:    torchrun ... examples/pretrain_gpt.py <your Megatron flags> --auto-parallel
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /opt/megatron-pipette
COPY setup.py requirements.txt README.md ./
COPY megatron_pipette ./megatron_pipette
COPY examples ./examples
COPY patches ./patches

# Keep the container's own torch, TE and apex; add megatron-core (pinned) and the package.
RUN pip install --no-cache-dir "megatron-core==0.19.2" \
 && pip install --no-cache-dir --no-deps -e .

ENTRYPOINT []
CMD ["pipette", "plan"]
