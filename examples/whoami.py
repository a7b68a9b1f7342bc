"""Print this rank's view of the job as one JSON line (used by the bootstrap tests)."""
import json

import hpcring

s = hpcring.init()
t = s.topology
print("TOPO " + json.dumps({"rank": t.rank, "size": t.size, "local_rank": t.local_rank, "local_size": t.local_size,
                            "node_rank": t.node_rank, "num_nodes": t.num_nodes, "hosts": list(t.hosts),
                            "host": t.host, "interface": t.interface, "address": t.address,
                            "master": [t.master_addr, t.master_port], "launcher": t.launcher}), flush=True)
