"""Tabular example: breast-cancer diagnosis with an MLP, AUROC first (conf/example/breast_cancer.yaml)."""
