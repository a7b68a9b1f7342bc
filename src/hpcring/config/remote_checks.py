"""The checks of a login node's settings (the site's ``remote:`` section, ``--remote``): host, user,
port, ssh options, workdir and the hpcring command there. Each ``*_problem`` returns why a value is
wrong (None when it is fine); the ssh option checks raise ValueError. Standard library only: the site
schema and :mod:`hpcring.remote` both use them."""
from __future__ import annotations

import ipaddress
import re

CONTROL_PERSIST_S = 600         # the shared master outlives the last command by at most this

# ssh_config keywords a site may set. hpcring owns Control*, and the target's own fields say
# User and Port; commands, TTYs and forwarding setup make no sense for a batch of short commands.
SSH_KEYWORDS = {k.lower(): k for k in (
    "AddKeysToAgent", "AddressFamily", "BatchMode", "BindAddress", "BindInterface", "CanonicalDomains",
    "CanonicalizeFallbackLocal", "CanonicalizeHostname", "CanonicalizeMaxDots", "CASignatureAlgorithms",
    "CertificateFile", "CheckHostIP", "Ciphers", "Compression", "ConnectionAttempts", "ConnectTimeout",
    "FingerprintHash", "ForwardAgent", "GlobalKnownHostsFile", "GSSAPIAuthentication",
    "GSSAPIDelegateCredentials", "HashKnownHosts", "HostbasedAcceptedAlgorithms", "HostbasedAuthentication",
    "HostKeyAlgorithms", "HostKeyAlias", "HostName", "IdentitiesOnly", "IdentityAgent", "IdentityFile",
    "IPQoS", "KbdInteractiveAuthentication", "KexAlgorithms", "KnownHostsCommand", "LogLevel", "MACs",
    "NoHostAuthenticationForLocalhost", "NumberOfPasswordPrompts", "PasswordAuthentication",
    "PKCS11Provider", "PreferredAuthentications", "ProxyCommand", "ProxyJump", "ProxyUseFdpass",
    "PubkeyAcceptedAlgorithms", "PubkeyAuthentication", "RekeyLimit", "RequiredRSASize", "SecurityKeyProvider",
    "ServerAliveCountMax", "ServerAliveInterval", "SetEnv", "SendEnv", "StrictHostKeyChecking", "TCPKeepAlive",
    "UpdateHostKeys", "UserKnownHostsFile", "VerifyHostKeyDNS", "VisualHostKey")}
_OWNED = {"controlmaster": "hpcring shares one connection itself", "controlpath": "hpcring keeps it private",
          "controlpersist": f"hpcring bounds it ({CONTROL_PERSIST_S} s)", "user": "use remote.user or user@host",
          "port": "use remote.port or host:port"}
# options whose value runs to the end of the line (ssh does not strip quotes from them)
TO_EOL = {"proxycommand", "knownhostscommand"}
_KEYWORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_HPCRING_CMD = re.compile(r"[A-Za-z0-9_./~+-]+")
_WORKDIR_BAD = set(" \t\"'\\$`;&|<>()*?[]{}!#\n\r")


def host_problem(host: str) -> str | None:
    if not host:
        return "host is empty"
    if host.startswith("-"):
        return f"host {host!r} starts with '-' (ssh would read it as an option)"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(lab) for lab in labels):
        return (f"host {host!r} is not a host name (letters, digits, '-' and '_' in dot-separated labels of "
                "at most 63 characters), an IPv4 address or an IPv6 address")
    return None


def user_problem(user: str) -> str | None:
    if not _USER.fullmatch(user):
        return (f"user {user!r} is not a login name (a letter or '_', then letters, digits, '_', '.' or '-'; "
                "at most 32 characters)")
    return None


def port_problem(port: int) -> str | None:
    return None if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535 \
        else f"port {port!r} is not a TCP port from 1 to 65535"


def ssh_option(text: str) -> tuple[str, str]:
    """``Key=Value`` (also ``-o Key=Value``, ``-oKey=Value``, ``Key Value``) as (Key, Value), the key
    spelt as ssh_config(5) does; ValueError saying what is wrong and what to write."""
    body = text[2:].lstrip() if text.startswith("-o") else text
    m = re.fullmatch(r"([^=\s]+)(?:\s*=\s*|\s+)(.*)", body.strip())
    if not m:
        raise ValueError(f"ssh option {text!r} is not Key=Value (e.g. IdentityFile=~/.ssh/id_ed25519)")
    return ssh_option_pair(m.group(1), m.group(2))


def ssh_option_pair(key: str, value: str) -> tuple[str, str]:
    low = key.lower()
    if low in _OWNED:
        raise ValueError(f"ssh option {key} is not for the site config: {_OWNED[low]}")
    if not _KEYWORD.fullmatch(key) or low not in SSH_KEYWORDS:
        raise ValueError(f"{key!r} is not an ssh option hpcring passes on (ssh_config(5) keywords such as "
                         "IdentityFile, ProxyJump, StrictHostKeyChecking, UserKnownHostsFile); anything else "
                         "belongs in ~/.ssh/config under a Host entry")
    if not value.strip() or value != value.strip():
        raise ValueError(f"ssh option {key} needs a value without leading or trailing spaces, got {value!r}")
    if any(ord(c) < 0x20 or c == "\x7f" for c in value):
        raise ValueError(f"ssh option {key}: its value holds a control character")
    if '"' in value and low not in TO_EOL:
        raise ValueError(f"ssh option {key}: its value holds '\"', which ssh's option parser cannot take")
    return SSH_KEYWORDS[low], value


def workdir_problem(workdir: str) -> str | None:
    bad = sorted(set(workdir) & _WORKDIR_BAD)
    tilde = "~" in (workdir[2:] if workdir.startswith("~/") else workdir.lstrip("~") if workdir == "~" else workdir)
    if not workdir or bad or tilde or workdir.startswith("-") or ".." in workdir.split("/"):
        return (f"workdir {workdir!r} is not a folder path on the login node without spaces, quotes, "
                "shell characters or '..' (relative paths are under the login user's home; ~/ too)")
    return None


def hpcring_problem(cmd: str) -> str | None:
    if not _HPCRING_CMD.fullmatch(cmd) or cmd.startswith("-"):
        return (f"hpcring command {cmd!r} is not one word (a path such as /opt/hpcring/.venv/bin/hpcring, "
                "or a name on the login node's PATH)")
    return None
