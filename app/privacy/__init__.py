"""Local differential privacy: DP-SGD in the ClientApp and the accountant histories the server keeps."""
