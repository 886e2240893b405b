import time, os, torch, numpy as np, mmap
torch.set_num_threads(1)
from benchmarks.weights import _state_dict
from protocol.shmweights import Segment, SegmentReader
from protocol import checksums
from protocol.weights import layout, write_tensors, build_manifest
sd=_state_dict(0.5)
infos,total=layout(sd,"bfloat16")
seg=Segment(total)
for i in range(3):
    t0=time.perf_counter(); write_tensors(seg.stream, infos, sd.values()); t1=time.perf_counter()
    m=build_manifest(1,"bfloat16",seg.stream,infos,total,chunk_bytes=32<<20,checksum_algo="crc32c"); t2=time.perf_counter()
    print(f"write {t1-t0:.3f} manifest {t2-t1:.3f}")
seg.end_write(1)
t0=time.perf_counter(); r=SegmentReader(seg.ref); t1=time.perf_counter(); print(f"map {t1-t0:.3f}")
out=np.empty(total,np.uint8); out[:]=0
for i in range(3):
    t0=time.perf_counter()
    for c in m.chunks:
        r.copy_chunk(1,c.offset,c.nbytes,c.checksum,"crc32c",out[c.offset:c.offset+c.nbytes])
    t1=time.perf_counter()
    out[:]=r.stream[:total]; t2=time.perf_counter()
    checksums.checksum("crc32c", out); t3=time.perf_counter()
    print(f"copy_chunks {t1-t0:.3f} plain copy {t2-t1:.3f} crc {t3-t2:.3f}")
