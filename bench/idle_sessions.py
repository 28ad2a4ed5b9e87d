#!/usr/bin/env python3
"""Open N idle iSCSI sessions to a target and keep them alive.

    idle_sessions.py HOST:PORT TARGET_IQN N [--hold SECONDS] [--ready FILE]
    idle_sessions.py HOST:PORT TARGET_IQN --probe ROUNDS

The second form times ROUNDS logins of one more session (each closed after its REPORT LUNS)
and ROUNDS REPORT LUNS of a session, and prints their median and worst in milliseconds with the
number of LUNs reported, for bench/session-scale.sh and bench/config-scale.sh.

Each session is its own TCP connection with its own ISID: a minimal login
(security stage with AuthMethod=None, then operational stage, straight to
full feature phase, target defaults for every other key), then nothing but
answers to the target's NOP-In pings (NOP-Out echoing the Target Transfer
Tag). One process, one selector loop: what is measured is the target's cost
per idle session, not ours. Against a 127.x target the sessions come
from 32 per loopback source address (ferrosan limits connections per source). Writes "ready <n>" to FILE (or stdout) once all
N sessions are in full feature phase, then holds them until SIGTERM or
--hold seconds.
"""
import selectors
import signal
import socket
import struct
import sys
import time

INITIATOR = "iqn.2024-01.dev.ferrosan:bench-idle"


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("target closed the connection")
        buf += chunk
    return buf


def pad4(n):
    return (n + 3) & ~3


def read_pdu(sock):
    bhs = recv_exact(sock, 48)
    ahs_len = bhs[4] * 4
    dlen = int.from_bytes(bhs[5:8], "big")
    rest = recv_exact(sock, ahs_len + pad4(dlen)) if ahs_len + dlen else b""
    return bhs, rest[ahs_len:ahs_len + dlen]


def login_pdu(isid, itt, csg, nsg, transit, cmdsn, expstatsn, keys):
    data = b"".join(k.encode() + b"=" + v.encode() + b"\0" for k, v in keys)
    flags = (0x80 if transit else 0) | (csg << 2) | nsg
    bhs = struct.pack(">BBBBB3s6sHIHHII16x", 0x43, flags, 0, 0, 0,
                      len(data).to_bytes(3, "big"), isid, 0, itt, 0, 0,
                      cmdsn, expstatsn)
    return bhs + data + b"\0" * (pad4(len(data)) - len(data))


def login(addr, iqn, index, src_index=None):
    host, port = addr.rsplit(":", 1)
    # ferrosan limits connections per source address (max_connections_per_source,
    # 64 by default): spread the sessions over 127.0.0.2, .3, ... (all loopback).
    src_index = index if src_index is None else src_index
    src = f"127.0.0.{2 + src_index // 32}" if host.startswith("127.") else ""
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(src, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # ISID: type 0x80 (random), unique per session.
    isid = bytes([0x80, 0x00]) + struct.pack(">I", 0x10000 + index)
    stages = [
        (0, 1, [("InitiatorName", INITIATOR), ("SessionType", "Normal"),
                ("TargetName", iqn), ("AuthMethod", "None")]),
        (1, 3, [("HeaderDigest", "None"), ("DataDigest", "None")]),
    ]
    statsn = 0
    for csg, nsg, keys in stages:
        for _ in range(8):  # a stage may take several exchanges
            sock.sendall(login_pdu(isid, index, csg, nsg, True, 1, statsn, keys))
            bhs, _data = read_pdu(sock)
            if bhs[0] & 0x3F != 0x23:
                raise RuntimeError(f"session {index}: unexpected opcode {bhs[0]:#x}")
            if bhs[36] != 0:
                raise RuntimeError(f"session {index}: login rejected, status {bhs[36]}/{bhs[37]}")
            statsn = struct.unpack(">I", bhs[24:28])[0] + 1
            keys = []
            if bhs[1] & 0x80:  # transit granted
                break
        else:
            raise RuntimeError(f"session {index}: target never granted the transit")
        if bhs[1] & 0x03 == 3:
            break
    sock.settimeout(None)
    return sock, statsn


def report_luns(sock, statsn, itt, cmdsn):
    """REPORT LUNS with room for every LUN there can be; returns (LUN count, ExpStatSN)."""
    alloc = 16 + 8 * 16384
    cdb = struct.pack(">BBB3xIBB", 0xA0, 0, 0, alloc, 0, 0).ljust(16, b"\0")
    bhs = (bytes([0x01, 0xC1, 0, 0, 0, 0, 0, 0]) + b"\0" * 8
           + struct.pack(">IIII", itt, alloc, cmdsn, statsn) + cdb)
    sock.sendall(bhs)
    data = b""
    while True:
        rbhs, rdata = read_pdu(sock)
        op = rbhs[0] & 0x3F
        if op == 0x25:  # Data-In
            data += rdata
            if rbhs[1] & 0x01:  # S bit: the status is in it
                return len_of(data), struct.unpack(">I", rbhs[24:28])[0] + 1
        elif op == 0x21:  # SCSI Response
            if rbhs[3] != 0:
                raise RuntimeError(f"REPORT LUNS: status {rbhs[3]:#x}")
            return len_of(data), struct.unpack(">I", rbhs[24:28])[0] + 1
        elif op != 0x20:  # a NOP-In may come between
            raise RuntimeError(f"REPORT LUNS: unexpected opcode {op:#x}")


def len_of(data):
    return struct.unpack(">I", data[:4])[0] // 8 if len(data) >= 4 else 0


def probe(addr, iqn, rounds):
    """Times logins and REPORT LUNS; prints one line for each."""
    logins, reports, luns = [], [], 0
    for r in range(rounds):
        t0 = time.perf_counter()
        # Its own ISID (no holder's session reinstated) from a source address of its own.
        sock, statsn = login(addr, iqn, 60000 + r, src_index=32 * 200)
        logins.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        luns, statsn = report_luns(sock, statsn, 1, 1)
        reports.append((time.perf_counter() - t0) * 1000)
        sock.close()
    if luns == 0:
        sys.exit("REPORT LUNS reported no LUN")
    for name, t in (("login", logins), ("report_luns", reports)):
        t.sort()
        print(f"{name} median_ms {t[len(t) // 2]:.3f} worst_ms {t[-1]:.3f} luns {luns}")
    return 0


def main():
    if len(sys.argv) == 5 and sys.argv[3] == "--probe":
        return probe(sys.argv[1], sys.argv[2], int(sys.argv[4]))
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    addr, iqn, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hold = 3600.0
    ready_file = None
    args = sys.argv[4:]
    while args:
        a = args.pop(0)
        if a == "--hold":
            hold = float(args.pop(0))
        elif a == "--ready":
            ready_file = args.pop(0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    state = {}
    for i in range(n):
        sock, statsn = login(addr, iqn, i + 1)
        state[sock] = [statsn, 2]  # ExpStatSN, CmdSN
        sel.register(sock, selectors.EVENT_READ)
    msg = f"ready {n}\n"
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(msg)
    else:
        sys.stdout.write(msg)
        sys.stdout.flush()
    deadline = time.monotonic() + hold
    pings = 0
    while time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            sock = key.fileobj
            bhs, _data = read_pdu(sock)
            st = state[sock]
            if bhs[0] & 0x3F == 0x20:  # NOP-In
                st[0] = struct.unpack(">I", bhs[24:28])[0] + 1
                ttt = bhs[20:24]
                if ttt != b"\xff\xff\xff\xff":  # a ping that wants an answer
                    out = (bytes([0x40, 0x80, 0, 0, 0, 0, 0, 0]) + bhs[8:16] + b"\xff\xff\xff\xff"
                           + ttt + struct.pack(">II", st[1], st[0]) + b"\0" * 16)
                    sock.sendall(out)
                    pings += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
