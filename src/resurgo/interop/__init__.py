"""Foreign checkpoints: importers that emit specs of the import language (:mod:`.spec`), one per
format (:mod:`.dcp`, :mod:`.hf`, :mod:`.torch_file`), the restricted unpickler they share
(:mod:`.unpickle`), and the one executor that writes a resurgo checkpoint
from a spec (:mod:`.execute`). ``resurgo.import_checkpoint`` is :func:`.api.import_checkpoint`."""
