"""Merge lane C's ViT rows (fedfuse's `average` rows at 9983f46: tier-models auto = slice for ViTs) into the digits
ViT cell, replacing that cell's earlier `average` rows (tier models pruned), run folders included."""
import json, shutil
from pathlib import Path
T = Path('/work/main/results/tiers')
cell, tmp = T / 'digits-vit-a0.1-t1-05-025', T / 'vit-rows-tmp'
new = json.loads((tmp / 'sweep.json').read_text())
labels = {r['strategy'] for r in new}
rows = [r for r in json.loads((cell / 'sweep.json').read_text()) if r['strategy'] not in labels] + new
(cell / 'sweep.json').write_text(json.dumps(rows, indent=2))
for d in tmp.iterdir():
    if d.is_dir():
        if (cell / d.name).exists():
            shutil.rmtree(cell / d.name)
        shutil.move(str(d), str(cell / d.name))
print(sorted({(r['strategy'], r['seed']) for r in rows}))
