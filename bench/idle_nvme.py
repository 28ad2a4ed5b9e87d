#!/usr/bin/env python3
"""Open N idle NVMe/TCP controllers to a subsystem and keep them alive.

    idle_nvme.py HOST:PORT SUBNQN N [--queues Q] [--keep-alive SECONDS] [--burst]
                 [--hold SECONDS] [--ready FILE] [--answered FILE]

Each controller is an admin queue and Q I/O queues (default 2), each queue its own TCP
connection: ICReq / ICResp (PFV 0, HPDA 0, no digests, MAXR2T 0), then a Fabrics Connect
(QID 0 with CNTLID FFFFh and a 120 s KATO for the admin queue; QID 1..Q with the controller ID
the admin Connect returned), SQSIZE 31. Between the admin queue and the I/O queues the
controller is enabled: Property Set CC (EN=1, IOSQES=6, IOCQES=4), then Property Get CSTS
until RDY, and one Asynchronous Event Request is left with it, as Linux's host does (it is
answered only when an event comes). Each controller has its own random host identifier and host
NQN (a device holds at most 32 of one host NQN). After that nothing but a Keep Alive on each
admin queue every 30 s (--keep-alive: Linux's host sends one every 2.5 s, half its default
5 s timeout). The controllers' Keep Alives are spread evenly over the interval, as the timers of
independent hosts are; --burst sends them all at once (hosts whose timers started together).
Every response's status is checked; anything unexpected ends the run with an error.

One process, one selector loop: what is measured is the target's cost per idle controller, not
ours. Against a 127.x target the queues come from 32 per loopback source address (ferrosan
limits connections per source). Writes "ready <n>" to FILE (or stdout) once all N controllers
and their queues are connected, then holds them until SIGTERM or --hold seconds; with
--answered, keeps the number of Keep Alives answered so far in FILE (rewritten each second).
"""
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import time
import uuid

KATO_MS = 120_000
KEEP_ALIVE_S = 30.0
SQSIZE = 31
CONNECTIONS_PER_SOURCE = 32

# PDU types (NVMe/TCP transport specification 1.0, 3.6.1).
ICREQ, ICRESP, C2H_TERM_REQ, CAPSULE_CMD, CAPSULE_RESP, C2H_DATA = 0x00, 0x01, 0x03, 0x04, 0x05, 0x07
# Fabrics (opcode 7Fh) command types, registers, and the admin Keep Alive.
FABRICS = 0x7F
FCTYPE_PROPERTY_SET, FCTYPE_CONNECT, FCTYPE_PROPERTY_GET = 0x00, 0x01, 0x04
REG_CC, REG_CSTS = 0x14, 0x1C
KEEP_ALIVE, ASYNC_EVENT_REQUEST = 0x18, 0x0C
AER_CID = 3
CC_ENABLE = 1 | 6 << 16 | 4 << 20  # EN, IOSQES 2^6 = 64 bytes, IOCQES 2^4 = 16 bytes


class NvmeFailure(Exception):
    pass


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise NvmeFailure("target closed the connection")
        buf += chunk
    return buf


def read_pdu(sock):
    """One PDU: (type, flags, header, data)."""
    ch = recv_exact(sock, 8)
    ptype, flags, hlen, pdo = ch[0], ch[1], ch[2], ch[3]
    plen = struct.unpack("<I", ch[4:8])[0]
    if hlen < 8 or plen < hlen:
        raise NvmeFailure(f"malformed PDU header {ch.hex()}")
    rest = recv_exact(sock, plen - 8)
    header = ch + rest[:hlen - 8]
    data = rest[pdo - 8:] if pdo else b""
    if ptype == C2H_TERM_REQ:
        fes, fei = struct.unpack("<HI", header[8:14])
        raise NvmeFailure(f"C2HTermReq: fatal error status {fes:#x}, field {fei:#x}")
    return ptype, flags, header, data


def sqe(opcode, cid, fctype=0, nsid=0):
    s = bytearray(64)
    s[0] = opcode
    s[1] = 0x40  # SGL for data transfer
    s[2:4] = struct.pack("<H", cid)
    if opcode == FABRICS:
        s[4] = fctype
    else:
        s[4:8] = struct.pack("<I", nsid)
    return s


def capsule(s, data=b""):
    """A command capsule PDU: no digests; in-capsule data right after the 72-byte header."""
    # The data pointer, one SGL descriptor: a data block of the data's length, offset subtype
    # (01h: the data is in the capsule); with no data, the transport's data block (5Ah), length 0.
    s[24:40] = b"\0" * 16
    s[32:36] = struct.pack("<I", len(data))
    s[39] = 0x01 if data else 0x5A
    pdo = 72 if data else 0
    return struct.pack("<BBBBI", CAPSULE_CMD, 0, 72, pdo, 72 + len(data)) + bytes(s) + data


def parse_cqe(header, what):
    """The CQE of a response capsule: (dw0, cid); a failing status raises."""
    if header[0] != CAPSULE_RESP or len(header) != 24:
        raise NvmeFailure(f"{what}: PDU type {header[0]:#x}, not a response capsule")
    dw0, _dw1, _sqhd, _sqid, cid, status = struct.unpack("<IIHHHH", header[8:24])
    sf = status >> 1
    if sf & 0x7FF:
        sct, sc = (sf >> 8) & 0x7, sf & 0xFF
        raise NvmeFailure(f"{what}: status SCT {sct} SC {sc:#04x} (dw0 {dw0:#x})")
    return dw0, cid


def run(sock, pdu, what):
    """Sends one command and waits for its completion (a queue has one command at a time)."""
    sock.sendall(pdu)
    while True:
        ptype, _flags, header, _data = read_pdu(sock)
        if ptype == C2H_DATA:  # no command here reads data; take it and wait for the response
            continue
        return parse_cqe(header, what)


def open_queue(host, port, src):
    sock = socket.create_connection((host, port), timeout=10, source_address=(src, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    icreq = struct.pack("<BBBBIHBBI", ICREQ, 0, 128, 0, 128, 0, 0, 0, 0).ljust(128, b"\0")
    sock.sendall(icreq)
    ptype, _flags, header, _data = read_pdu(sock)
    if ptype != ICRESP or len(header) != 128:
        raise NvmeFailure(f"expected ICResp, got PDU type {ptype:#x}")
    pfv, cpda, dgst, maxh2cdata = struct.unpack("<HBBI", header[8:16])
    if pfv != 0 or dgst != 0 or maxh2cdata < 4096:
        raise NvmeFailure(f"ICResp: PFV {pfv}, CPDA {cpda}, DGST {dgst:#x}, MAXH2CDATA {maxh2cdata}")
    return sock


def connect(sock, qid, cntlid, host_id, subnqn, hostnqn):
    s = sqe(FABRICS, 0, FCTYPE_CONNECT)
    s[42:44] = struct.pack("<H", qid)
    s[44:46] = struct.pack("<H", SQSIZE)
    s[48:52] = struct.pack("<I", KATO_MS if qid == 0 else 0)
    data = bytearray(1024)
    data[0:16] = host_id
    data[16:18] = struct.pack("<H", cntlid)
    data[256:256 + len(subnqn)] = subnqn.encode()
    data[512:512 + len(hostnqn)] = hostnqn.encode()
    dw0, _cid = run(sock, capsule(s, bytes(data)), f"Connect QID {qid}")
    if dw0 & 1 << 17:
        raise NvmeFailure(f"Connect QID {qid}: the controller asks for authentication")
    return dw0 & 0xFFFF


def property_set_cc(sock, value):
    s = sqe(FABRICS, 1, FCTYPE_PROPERTY_SET)
    s[40] = 0  # ATTRIB: a 4-byte property
    s[44:48] = struct.pack("<I", REG_CC)
    s[48:56] = struct.pack("<Q", value)
    run(sock, capsule(s), "Property Set CC")


def property_get_csts(sock):
    s = sqe(FABRICS, 2, FCTYPE_PROPERTY_GET)
    s[40] = 0
    s[44:48] = struct.pack("<I", REG_CSTS)
    dw0, _cid = run(sock, capsule(s), "Property Get CSTS")
    return dw0


def controller(addr, subnqn, index, queues):
    """Connects one controller; returns its admin socket and every queue's socket."""
    host, port = addr.rsplit(":", 1)
    port = int(port)
    per = queues + 1
    socks = []
    for q in range(per):
        # ferrosan limits connections per source address (max_connections_per_source, 64 by
        # default): spread the queues over 127.0.0.2, .3, ... (all loopback).
        n = index * per + q
        k = n // CONNECTIONS_PER_SOURCE
        src = f"127.0.{k // 250}.{2 + k % 250}" if host.startswith("127.") else ""
        socks.append((src, q))
    host_uuid = uuid.UUID(bytes=os.urandom(16), version=4)
    host_id = host_uuid.bytes
    hostnqn = f"nqn.2014-08.org.nvmexpress:uuid:{host_uuid}"
    admin = open_queue(host, port, socks[0][0])
    cntlid = connect(admin, 0, 0xFFFF, host_id, subnqn, hostnqn)
    property_set_cc(admin, CC_ENABLE)
    deadline = time.monotonic() + 10
    while not property_get_csts(admin) & 1:  # CSTS.RDY
        if time.monotonic() > deadline:
            raise NvmeFailure(f"controller {cntlid}: CSTS.RDY not set after 10 s")
        time.sleep(0.01)
    admin.sendall(capsule(sqe(ASYNC_EVENT_REQUEST, AER_CID)))
    out = [admin]
    for src, q in socks[1:]:
        io = open_queue(host, port, src)
        connect(io, q, cntlid, host_id, subnqn, hostnqn)
        io.settimeout(None)
        out.append(io)
    admin.settimeout(None)
    return cntlid, out


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    addr, subnqn, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    queues, hold, ready_file, keep_alive_s, burst = 2, 3600.0, None, KEEP_ALIVE_S, False
    answered_file = None
    args = sys.argv[4:]
    while args:
        a = args.pop(0)
        if a == "--queues":
            queues = int(args.pop(0))
        elif a == "--keep-alive":
            keep_alive_s = float(args.pop(0))
        elif a == "--burst":
            burst = True
        elif a == "--hold":
            hold = float(args.pop(0))
        elif a == "--answered":
            answered_file = args.pop(0)
        elif a == "--ready":
            ready_file = args.pop(0)
        else:
            sys.exit(f"unknown argument {a}\n{__doc__}")
    # A socket per queue: take every descriptor the hard limit allows.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sel = selectors.DefaultSelector()
    admins = {}  # admin socket -> [controller ID, next command identifier]
    try:
        for i in range(n):
            cntlid, socks = controller(addr, subnqn, i, queues)
            admins[socks[0]] = [cntlid, 16]
            for s in socks:
                sel.register(s, selectors.EVENT_READ, socks[0])
    except (NvmeFailure, OSError) as e:
        sys.exit(f"controller {len(admins) + 1} of {n}: {e}")
    msg = f"ready {n}\n"
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(msg)
    else:
        sys.stdout.write(msg)
        sys.stdout.flush()
    deadline = time.monotonic() + hold
    order = list(admins)
    # The next Keep Alive is order[due]'s at next_ka; each controller's comes keep_alive_s after
    # its last, the controllers `step` apart (all together with --burst).
    step = 0.0 if burst else keep_alive_s / len(order)
    due, next_ka = 0, time.monotonic() + keep_alive_s
    answered, told = 0, time.monotonic()
    try:
        while time.monotonic() < deadline:
            if answered_file and time.monotonic() - told >= 1.0:
                told = time.monotonic()
                with open(answered_file + ".new", "w") as f:
                    f.write(f"{answered}\n")
                os.replace(answered_file + ".new", answered_file)
            while time.monotonic() >= next_ka:
                admin = order[due]
                st = admins[admin]
                st[1] = 16 + (st[1] - 15) % 0x1000  # CIDs 16..4111, apart from the connect's
                admin.sendall(capsule(sqe(KEEP_ALIVE, st[1])))
                due = (due + 1) % len(order)
                next_ka += step if due else keep_alive_s - step * (len(order) - 1)
            wait = min(1.0, max(0.0, next_ka - time.monotonic()))
            for key, _ in sel.select(timeout=wait):
                sock, admin = key.fileobj, key.data
                _ptype, _flags, header, _data = read_pdu(sock)
                what = f"controller {admins[admin][0]}" + ("" if sock is admin else " I/O queue")
                # Only Keep Alive completions are expected, on an admin queue.
                _dw0, cid = parse_cqe(header, f"{what}: Keep Alive")
                if sock is not admin or cid != admins[admin][1]:
                    raise NvmeFailure(f"{what}: an unexpected completion (CID {cid})")
                answered += 1
    except (NvmeFailure, OSError) as e:
        sys.exit(f"while holding: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
