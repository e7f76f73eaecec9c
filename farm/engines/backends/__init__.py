"""Backends: OpenCV's DNN module (CPU default), PyTorch (CPU or CUDA) and pycaffe."""
