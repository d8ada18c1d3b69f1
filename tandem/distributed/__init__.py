"""Beyond one GPU: tensor-parallel decode over the GPUs of one host (`tensor_parallel`, started by `launch`).
Replicas across hosts are served by Ray (`tandem.serve.replicas`)."""
