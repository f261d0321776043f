"""Fine-tuning example: pretrain the default CNN centrally on one half of the digits, then
fine-tune only its classifier head federatedly on the other half, and compare the bytes per
reply with full-model training (conf/example/finetune.yaml; run: python -m examples.finetune)."""
