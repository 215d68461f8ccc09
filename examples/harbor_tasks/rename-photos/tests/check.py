"""Partial credit: the share of the three photos renamed with their content kept; 0 if notes.txt was touched."""

import json
import os

photos = "/workdir/photos"
done = 0
for i in (1, 2, 3):
    path = os.path.join(photos, f"IMG_00{i}.jpg")
    if os.path.isfile(path) and not os.path.exists(os.path.join(photos, f"IMG_00{i}.JPG")):
        with open(path) as f:
            done += f.read() == f"not really a jpeg, photo {i}\n"
notes = os.path.join(photos, "notes.txt")
intact = os.path.isfile(notes) and open(notes).read() == "shot on holiday\n"
reward = done / 3 if intact else 0.0
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": reward, "renamed": done, "notes_intact": int(intact)}, f)
