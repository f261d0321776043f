"""`python -m examples.finetune --out DIR`: see examples/finetune/run.py."""

from examples.finetune.run import main

main()
