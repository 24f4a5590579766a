"""π0.5 (Physical Intelligence), a vision-language-action policy: see model.py."""
