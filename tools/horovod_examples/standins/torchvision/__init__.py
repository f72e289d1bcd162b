"""A stand-in for torchvision, for running Horovod's PyTorch examples here without downloads.

torchvision has no CPU wheel in this environment, and Horovod's examples would download MNIST or
ImageNet-sized models. This package gives them what they import, small and synthetic:
`datasets.MNIST` (random 28x28 images with labels, made from a seed, never downloaded),
`transforms.Compose/ToTensor/Normalize`, and `models.<name>(...)` (a small residual network
standing in for ResNet-50 and friends, honouring `norm_layer` and `num_classes`). It is put on
`sys.path` only by `tools/horovod_examples/run.py`.
"""

from torchvision import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
