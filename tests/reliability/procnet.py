"""Listening TCP sockets of a process tree, read from /proc (Linux): for the loopback-only check."""

from __future__ import annotations

import os
import socket
import struct


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    except OSError:
        pass
    return found


def _decode(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if v6:
        words = struct.unpack("<4I", raw)
        return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
    return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))


def _listeners() -> dict[str, tuple[str, int]]:
    """{socket inode: (address, port)} of every TCP socket in LISTEN state on this machine (IPv4 and IPv6)."""
    found = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A":
                addr, port = local.split(":")
                found[inode] = (_decode(addr, v6), int(port, 16))
    return found


def listening(pid: int) -> set[tuple[str, int]]:
    """{(address, port)} of TCP sockets in LISTEN state owned by pid or its descendants."""
    inodes = set()
    for p in process_tree(pid):
        inodes |= _socket_inodes(p)
    return {where for inode, where in _listeners().items() if inode in inodes}


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1" or address.startswith("::ffff:127.")


def listening_by_process(pid: int) -> dict[int, set[tuple[str, int]]]:
    """{pid: {(address, port)}}: the TCP sockets in LISTEN state each process of pid's tree owns (those with any)."""
    listeners = _listeners()
    out = {}
    for p in process_tree(pid):
        found = {listeners[i] for i in _socket_inodes(p) if i in listeners}
        if found:
            out[p] = found
    return out
