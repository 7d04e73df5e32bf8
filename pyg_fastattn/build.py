"""``python -m pyg_fastattn.build``: build the kernels now and report."""
import sys

from ._build import info


def main() -> int:
    i = info()
    cpu = 'native' if i['native_cpu'] else 'reference'
    if i['native_cuda']:
        cuda = 'native'
    elif i['cuda_available']:
        cuda = 'reference'
    else:
        cuda = 'unavailable (no GPU visible)'
    print(f"pyg_fastattn backends: cpu={cpu} cuda={cuda}")
    print(f"torch {i['torch']} (CUDA {i['cuda']}); build dir: {i['build_dir']}")
    if i['reason']:
        print(f"native kernels unavailable: {i['reason'].splitlines()[0]}")
    return 0 if i['native_cpu'] else 1


if __name__ == '__main__':
    sys.exit(main())
