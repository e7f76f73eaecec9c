"""Running a model: ``engine`` loads one on a backend (``backends/``) at a precision,
``autoselect`` times the candidates and picks the fastest (``auto``), ``modelcheck`` compares
their outputs (``tolerances`` says when two agree), ``preprocess`` and ``images`` turn pixels
and image files into its input, and ``onnx_export`` writes the ONNX file the ONNX Runtime and
OpenVINO backends load."""
