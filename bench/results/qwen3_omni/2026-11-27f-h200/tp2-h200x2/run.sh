python3 bench/qwen3_omni/decode_step.py --device cuda --parts thinker --tp 2 --compiled --root /tmp/omni-m --batch 16 --out $OUT/tp2.json   # 2x H200, the code of b8117d3
