"""`dflash train-drafter`: data, objective, checkpoints. Sits above engine and chat (it renders prompts)."""
