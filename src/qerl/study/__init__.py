"""The quantization strategy comparison (issue: does quantization noise help exploration here?)."""
