"""The seed guides' APIs on tensor_ops, one module per project, so that code
written against them runs after its import lines change (docs/migration.md):

- tensor_ops.compat.kernel_pytorch: KernelPyTorch (backend selection and
  unification guides, the NVIDIA backend page)
- tensor_ops.compat.torchbridge: TorchBridge (backend selection guide)
- tensor_ops.compat.airllm: airllm's tensor_ops module and its per-backend
  modules; `python -m tensor_ops.compat.airllm detect_and_benchmark`

Nothing in tensor_ops imports these; they import torch (airllm: numpy only)."""
