"""The embedded S3 store (SeaweedFS 4.48) as the S3 tier relies on it: loopback only, checksums
verified, conditional writes, credentials enforced, orphaned multipart uploads visible, data kept
across kill -9. A real server: no mocks (moto accepts any key and any checksum)."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aioboto3
import boto3
import botocore.exceptions
import pytest
from awscrt import checksums
from botocore.config import Config

from tierpipe.dev import S3Server
from tierpipe.errors import TierpipeError

#: Fail at once on loopback: one attempt (max_attempts counts retries; total_max_attempts counts
#: attempts), a short connect timeout.
FAST = Config(
    connect_timeout=1,
    read_timeout=10,
    retries={"total_max_attempts": 1, "mode": "standard"},
    s3={"addressing_style": "path"},
)
MIB = 1024 * 1024


def crc32c_b64(data: bytes) -> str:
    """What S3 wants in ChecksumCRC32C: base64 of the 4-byte big-endian CRC32C."""
    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


def composite_crc32c(parts: list[bytes]) -> str:
    """A COMPOSITE multipart checksum: CRC32C of the parts' raw CRC32Cs, then `-<parts>`."""
    raw = b"".join(checksums.crc32c(p).to_bytes(4, "big") for p in parts)
    return f"{crc32c_b64(raw)}-{len(parts)}"


def error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    return exc.response["Error"]["Code"], exc.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.fixture
def s3(s3_server: S3Server) -> Iterator[Any]:
    client = boto3.client("s3", **s3_server.client_kwargs(), config=FAST)
    yield client
    client.close()


@pytest.fixture
async def aio_s3(s3_server: S3Server) -> AsyncIterator[Any]:
    """One long-lived aioboto3 client, as the S3 tier holds one."""
    async with aioboto3.Session().client("s3", **s3_server.client_kwargs(), config=FAST) as client:
        yield client


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address hex, port) of every TCP socket `pid` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and f"socket:[{inode}]" in inodes:  # 0A: LISTEN
                addr, port = local.split(":")
                found.add((addr, int(port, 16)))
    return found


def _socket_files(port: int) -> list[Path]:
    return list(Path("/tmp").glob(f"seaweedfs-*-{port}.sock"))


def _non_loopback_addresses() -> set[str]:
    found = set()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: just picks the outgoing address
        found.add(s.getsockname()[0])
    with contextlib.suppress(OSError):
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return {a for a in found if not a.startswith("127.") and a != "0.0.0.0"}


def test_listens_on_loopback_only_on_ports_outside_the_ephemeral_range(
    s3_server: S3Server,
) -> None:
    assert s3_server.proc is not None
    listening = _listening_addresses(s3_server.proc.pid)
    assert listening, "weed listens on nothing?"
    assert {addr for addr, _ in listening} == {"0100007F"}  # 127.0.0.1, nothing else
    ports = {port for _, port in listening}
    assert s3_server.ports["s3"] in ports
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for port in s3_server.ports.values():
        for p in (port, port + 10000):
            assert not lo <= p <= hi, (p, lo, hi)
    assert s3_server.endpoint == f"http://127.0.0.1:{s3_server.ports['s3']}"

    for address in _non_loopback_addresses():
        with (
            pytest.raises((ConnectionRefusedError, TimeoutError)),
            socket.create_connection((address, s3_server.ports["s3"]), 1),
        ):
            pass


@pytest.mark.anyio
async def test_multipart_crc32c_is_verified_and_conditional(aio_s3: Any, s3_bucket: str) -> None:
    """The whole multipart cycle the S3 tier uses, on one long-lived aioboto3 client."""
    key = "ckpt/step-1/shard-0"
    parts = [os.urandom(5 * MIB), os.urandom(MIB + 7)]
    up = await aio_s3.create_multipart_upload(Bucket=s3_bucket, Key=key, ChecksumAlgorithm="CRC32C")
    assert (up["ChecksumAlgorithm"], up["ChecksumType"]) == ("CRC32C", "COMPOSITE")

    # A part whose data does not match its checksum is refused: the store verifies. (The last
    # byte is flipped, not set: random data ends in a zero byte one time in 256, CI's failure.)
    with pytest.raises(botocore.exceptions.ClientError) as bad:
        await aio_s3.upload_part(
            Bucket=s3_bucket,
            Key=key,
            UploadId=up["UploadId"],
            PartNumber=1,
            Body=parts[0],
            ChecksumCRC32C=crc32c_b64(parts[0][:-1] + bytes([parts[0][-1] ^ 0xFF])),
        )
    assert error_code(bad.value) == ("BadDigest", 400)

    done = []
    for number, data in enumerate(parts, 1):
        r = await aio_s3.upload_part(
            Bucket=s3_bucket,
            Key=key,
            UploadId=up["UploadId"],
            PartNumber=number,
            Body=data,
            ChecksumCRC32C=crc32c_b64(data),
        )
        assert r["ChecksumCRC32C"] == crc32c_b64(data)
        done.append(
            {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": r["ChecksumCRC32C"]}
        )
    r = await aio_s3.complete_multipart_upload(
        Bucket=s3_bucket,
        Key=key,
        UploadId=up["UploadId"],
        MultipartUpload={"Parts": done},
        IfNoneMatch="*",
    )
    assert r["ChecksumCRC32C"] == composite_crc32c(parts)

    head = await aio_s3.head_object(Bucket=s3_bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ContentLength"] == sum(map(len, parts))
    assert (head["ChecksumCRC32C"], head["ChecksumType"]) == (composite_crc32c(parts), "COMPOSITE")
    whole = b"".join(parts)
    got = await aio_s3.get_object(Bucket=s3_bucket, Key=key, Range="bytes=5242870-5242889")
    assert got["ContentRange"] == f"bytes 5242870-5242889/{len(whole)}"
    assert await got["Body"].read() == whole[5242870:5242890]

    # Completing a second upload onto the existing key with IfNoneMatch="*": 412, and the loser's
    # upload stays open until aborted.
    again = await aio_s3.create_multipart_upload(
        Bucket=s3_bucket, Key=key, ChecksumAlgorithm="CRC32C"
    )
    r = await aio_s3.upload_part(
        Bucket=s3_bucket,
        Key=key,
        UploadId=again["UploadId"],
        PartNumber=1,
        Body=b"other",
        ChecksumCRC32C=crc32c_b64(b"other"),
    )
    with pytest.raises(botocore.exceptions.ClientError) as lost:
        await aio_s3.complete_multipart_upload(
            Bucket=s3_bucket,
            Key=key,
            UploadId=again["UploadId"],
            MultipartUpload={
                "Parts": [
                    {"PartNumber": 1, "ETag": r["ETag"], "ChecksumCRC32C": r["ChecksumCRC32C"]}
                ]
            },
            IfNoneMatch="*",
        )
    assert error_code(lost.value) == ("PreconditionFailed", 412)
    head = await aio_s3.head_object(Bucket=s3_bucket, Key=key)
    assert head["ContentLength"] == len(whole)  # untouched
    listed = await aio_s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="ckpt/")
    assert [u["UploadId"] for u in listed.get("Uploads", [])] == [again["UploadId"]]
    await aio_s3.abort_multipart_upload(Bucket=s3_bucket, Key=key, UploadId=again["UploadId"])


@pytest.mark.anyio
async def test_complete_with_a_wrong_part_checksum_is_refused(aio_s3: Any, s3_bucket: str) -> None:
    up = await aio_s3.create_multipart_upload(Bucket=s3_bucket, Key="k", ChecksumAlgorithm="CRC32C")
    r = await aio_s3.upload_part(
        Bucket=s3_bucket,
        Key="k",
        UploadId=up["UploadId"],
        PartNumber=1,
        Body=b"data",
        ChecksumCRC32C=crc32c_b64(b"data"),
    )
    with pytest.raises(botocore.exceptions.ClientError) as bad:
        await aio_s3.complete_multipart_upload(
            Bucket=s3_bucket,
            Key="k",
            UploadId=up["UploadId"],
            MultipartUpload={
                "Parts": [{"PartNumber": 1, "ETag": r["ETag"], "ChecksumCRC32C": crc32c_b64(b"x")}]
            },
        )
    assert error_code(bad.value) == ("BadDigest", 400)
    await aio_s3.abort_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=up["UploadId"])


@pytest.mark.anyio
async def test_full_object_crc32c_is_checked_at_complete(aio_s3: Any, s3_bucket: str) -> None:
    """ChecksumType FULL_OBJECT: the server combines the part CRC32Cs into the whole object's
    CRC32C, compares it with the one sent to complete (400 BadDigest if different), and
    head_object returns it (no `-N` suffix), so it can be compared with a locally computed one."""
    parts = [os.urandom(5 * MIB), os.urandom(MIB)]
    whole = b"".join(parts)
    for key, claimed in (("bad", crc32c_b64(b"something else")), ("good", crc32c_b64(whole))):
        up = await aio_s3.create_multipart_upload(
            Bucket=s3_bucket, Key=key, ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT"
        )
        assert up["ChecksumType"] == "FULL_OBJECT"
        done = []
        for number, data in enumerate(parts, 1):
            r = await aio_s3.upload_part(
                Bucket=s3_bucket,
                Key=key,
                UploadId=up["UploadId"],
                PartNumber=number,
                Body=data,
                ChecksumCRC32C=crc32c_b64(data),
            )
            done.append(
                {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": crc32c_b64(data)}
            )
        complete = aio_s3.complete_multipart_upload(
            Bucket=s3_bucket,
            Key=key,
            UploadId=up["UploadId"],
            MultipartUpload={"Parts": done},
            ChecksumCRC32C=claimed,
            ChecksumType="FULL_OBJECT",
            IfNoneMatch="*",
        )
        if key == "bad":
            with pytest.raises(botocore.exceptions.ClientError) as exc:
                await complete
            assert error_code(exc.value) == ("BadDigest", 400)
            await aio_s3.abort_multipart_upload(Bucket=s3_bucket, Key=key, UploadId=up["UploadId"])
        else:
            assert (await complete)["ChecksumCRC32C"] == crc32c_b64(whole)
    head = await aio_s3.head_object(Bucket=s3_bucket, Key="good", ChecksumMode="ENABLED")
    assert (head["ChecksumCRC32C"], head["ChecksumType"]) == (crc32c_b64(whole), "FULL_OBJECT")
    with pytest.raises(botocore.exceptions.ClientError):
        await aio_s3.head_object(Bucket=s3_bucket, Key="bad")
    got = await aio_s3.get_object(Bucket=s3_bucket, Key="good")  # botocore verifies the CRC32C
    assert await got["Body"].read() == whole


def test_put_if_none_match_on_an_existing_key_is_412(s3: Any, s3_bucket: str) -> None:
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert error_code(exc.value) == ("PreconditionFailed", 412)
    assert s3.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"first"
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.put_object(Bucket=s3_bucket, Key="k2", Body=b"y", ChecksumCRC32C=crc32c_b64(b"x"))
    assert error_code(exc.value) == ("BadDigest", 400)


@pytest.mark.parametrize(
    ("wrong", "code"),
    [("access_key", "InvalidAccessKeyId"), ("secret_key", "SignatureDoesNotMatch")],
)
def test_wrong_credentials_are_rejected(
    s3_server: S3Server, s3_bucket: str, wrong: str, code: str
) -> None:
    kwargs = s3_server.client_kwargs()
    kwargs["aws_access_key_id" if wrong == "access_key" else "aws_secret_access_key"] = "wrong"
    client = boto3.client("s3", **kwargs, config=FAST)
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"x")
    assert error_code(exc.value) == (code, 403)
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        client.list_objects_v2(Bucket=s3_bucket)
    assert error_code(exc.value) == (code, 403)
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        client.head_bucket(Bucket=s3_bucket)  # a HEAD answer has no body: the status only
    assert error_code(exc.value) == ("403", 403)


def test_missing_bucket_is_not_created_behind_our_back(s3: Any) -> None:
    with pytest.raises(s3.exceptions.NoSuchBucket):
        s3.put_object(Bucket="no-such-bucket-here", Key="k", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as exc:
        s3.head_bucket(Bucket="no-such-bucket-here")
    assert error_code(exc.value) == ("404", 404)


def test_orphaned_multipart_upload_is_listed_and_aborted(s3: Any, s3_bucket: str) -> None:
    """An uploader killed mid-upload leaves its upload (and parts) behind until aborted."""
    up = s3.create_multipart_upload(Bucket=s3_bucket, Key="job/a/shard", ChecksumAlgorithm="CRC32C")
    s3.upload_part(
        Bucket=s3_bucket,
        Key="job/a/shard",
        UploadId=up["UploadId"],
        PartNumber=1,
        Body=b"x" * 1000,
        ChecksumCRC32C=crc32c_b64(b"x" * 1000),
    )
    s3.create_multipart_upload(Bucket=s3_bucket, Key="other/b", ChecksumAlgorithm="CRC32C")

    listed = s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="job/")
    assert [(u["Key"], u["UploadId"]) for u in listed["Uploads"]] == [
        ("job/a/shard", up["UploadId"])
    ]
    assert listed["Uploads"][0]["Initiated"].timestamp() > time.time() - 600
    s3.abort_multipart_upload(Bucket=s3_bucket, Key="job/a/shard", UploadId=up["UploadId"])
    assert "Uploads" not in s3.list_multipart_uploads(Bucket=s3_bucket, Prefix="job/")
    with pytest.raises(s3.exceptions.NoSuchUpload):
        s3.upload_part(
            Bucket=s3_bucket,
            Key="job/a/shard",
            UploadId=up["UploadId"],
            PartNumber=2,
            Body=b"y",
            ChecksumCRC32C=crc32c_b64(b"y"),
        )


@pytest.mark.anyio
async def test_outage_fails_fast_and_the_same_client_reconnects(
    s3_server: S3Server, aio_s3: Any, s3_bucket: str
) -> None:
    """kill -9 mid-run: calls fail at once with EndpointConnectionError; after restart() the same
    client reaches the same endpoint and the data written before is there."""
    endpoint = s3_server.endpoint
    await aio_s3.put_object(Bucket=s3_bucket, Key="before", Body=b"kept")
    s3_server.kill()
    assert not _socket_files(s3_server.ports["s3"])
    started = time.monotonic()
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        await aio_s3.put_object(Bucket=s3_bucket, Key="during", Body=b"lost")
    assert time.monotonic() - started < 1.0

    s3_server.restart()
    assert s3_server.endpoint == endpoint
    got = await aio_s3.get_object(Bucket=s3_bucket, Key="before")
    assert await got["Body"].read() == b"kept"
    await aio_s3.put_object(Bucket=s3_bucket, Key="after", Body=b"ok")


def test_lifecycle_kill_restart_stop(tmp_path: Path) -> None:
    """Its own server: ready quickly, data kept across kill -9, stop() idempotent and clean."""
    server = S3Server(tmp_path / "s3", access_key="k-test", secret_key="s-test", bucket="life")
    started = time.monotonic()
    with server:
        ready_s = time.monotonic() - started
        assert ready_s < 10, ready_s
        assert server.proc is not None
        pid, ports, endpoint = server.proc.pid, dict(server.ports), server.endpoint
        client = boto3.client("s3", **server.client_kwargs(), config=FAST)
        client.put_object(Bucket="life", Key="k", Body=b"v" * 100_000)

        server.kill()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        server.restart()
        assert (server.ports, server.endpoint) == (ports, endpoint)
        client = boto3.client("s3", **server.client_kwargs(), config=FAST)
        assert client.get_object(Bucket="life", Key="k")["Body"].read() == b"v" * 100_000
        pid = server.proc.pid
    server.stop()  # again: a no-op
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    for port in ports.values():
        for p in (port, port + 10000):
            assert not _socket_files(p)
    assert (tmp_path / "s3" / "weed.log").exists()


def test_a_port_taken_at_start_is_replaced_but_not_on_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port taken between the bind test and weed's start: new ports. On restart the endpoint
    must not move, so a taken port is an error."""
    import tierpipe.dev.s3 as s3

    real = s3._free_port_pairs
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        calls = []

        def first_taken(n: int) -> list[int]:
            ports = real(n)
            if not calls:
                ports[3] = taken  # the S3 port
            calls.append(ports)
            return ports

        monkeypatch.setattr(s3, "_free_port_pairs", first_taken)
        with S3Server(tmp_path, access_key="k-test", secret_key="s-test", bucket="clash") as server:
            assert len(calls) == 2
            assert server.ports["s3"] == calls[1][3] != taken
            server.kill()
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its TIME_WAITs
                other.bind(("127.0.0.1", server.ports["s3"]))
                other.listen()
                with pytest.raises(TierpipeError, match="could not bind"):
                    server.restart()
            server.restart()
            assert server.endpoint == f"http://127.0.0.1:{calls[1][3]}"


@pytest.mark.anyio
async def test_a_request_the_store_does_not_implement_is_permanent_not_an_outage() -> None:
    """A 501 NotImplemented (a store without conditional writes) is a clear permanent error,
    never an outage that would be retried forever."""
    from botocore.exceptions import ClientError

    from tierpipe.errors import StorageUnsupportedError, UnavailableError
    from tierpipe.storage.s3.errors import translate_errors

    refused = ClientError(
        {
            "Error": {"Code": "NotImplemented", "Message": "If-Match is not supported"},
            "ResponseMetadata": {"HTTPStatusCode": 501},
        },
        "DeleteObject",
    )
    with pytest.raises(StorageUnsupportedError, match="conditional writes") as err:
        async with translate_errors("k"):
            raise refused
    assert not isinstance(err.value, UnavailableError)
