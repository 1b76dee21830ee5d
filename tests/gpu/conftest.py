# The tests in this folder need CUDA: tools/gpu_check.sh runs them on a GPU machine. Without CUDA
# they are not collected at all (rather than reported as skipped), so a CPU run counts only what ran.
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
