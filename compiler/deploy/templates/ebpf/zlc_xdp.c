// SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0)
/*
 * zlc XDP ingress: binary token frames (docs/frames.md) arriving over UDP to the serving port are
 * validated here and copied once into a BPF ring buffer, which `zlc serve --xdp IFACE` drains into
 * the request ring. Nothing is dropped silently: any frame this program does not take -- a full
 * ring, a frame too long for a ring record, a malformed frame, anything it is unsure about -- goes
 * on with XDP_PASS to the kernel's UDP stack, where zlc serve's UDP socket answers it (results, or
 * an ERROR frame). Every other packet passes untouched.
 *
 * Counters (per-CPU array `zlc_stats`): 0 accepted (in the ring), 1 malformed (passed to the
 * socket), 2 ring full (passed), 3 too long for a record (passed).
 *
 * Build: clang -O2 -g -target bpf -DZLC_MAX_TOKENS=N -c zlc_xdp.c -o zlc_xdp.o  (BTF from -g)
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#ifndef ZLC_MAX_TOKENS
#define ZLC_MAX_TOKENS 1024 /* prompt tokens one ring record holds; longer frames go to the socket */
#endif
#ifndef ZLC_RING_BYTES
#define ZLC_RING_BYTES (1 << 22) /* a power of two, a multiple of the page size */
#endif

#define ZLC_MAGIC 0x46434C5A /* "ZLCF" little-endian */
#define ZLC_VERSION 1
#define ZLC_HEADER 24
#define ZLC_FRAME_BYTES (ZLC_HEADER + 4 * ZLC_MAX_TOKENS)

enum { STAT_ACCEPTED, STAT_MALFORMED, STAT_RING_FULL, STAT_TOO_LONG, STAT_N };

/* What one ring record holds: the frame as received plus the sender, so results can be sent back
 * from the serving UDP socket. Layout mirrored in runtime/serve/ingress/xdp.py. */
struct zlc_record {
	__u32 frame_len; /* bytes of frame[] in use */
	__u32 src_addr;  /* IPv4 source address, network byte order */
	__u16 src_port;  /* UDP source port, network byte order */
	__u16 reserved;
	__u32 reserved2;
	__u8 frame[ZLC_FRAME_BYTES];
};

struct zlc_header {
	__u32 magic;
	__u16 version;
	__u16 flags;
	__u64 request_id;
	__u32 max_tokens;
	__u32 n_tokens;
} __attribute__((packed));

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, ZLC_RING_BYTES);
} zlc_ring SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_N);
	__type(key, __u32);
	__type(value, __u64);
} zlc_stats SEC(".maps");

/* Set by the loader before attaching: [0] = the serving UDP port (host order). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} zlc_config SEC(".maps");

static __always_inline int count(__u32 what, int verdict)
{
	__u64 *n = bpf_map_lookup_elem(&zlc_stats, &what);
	if (n)
		*n += 1; /* per-CPU slot: no atomics needed */
	return verdict;
}

SEC("xdp")
int zlc_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP)
		return XDP_PASS;
	if (ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3FFF)))
		return XDP_PASS; /* IP options or fragments: the socket reassembles and answers */
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return XDP_PASS;
	__u32 zero = 0;
	__u32 *port = bpf_map_lookup_elem(&zlc_config, &zero);
	if (!port || *port == 0 || udp->dest != bpf_htons((__u16)*port))
		return XDP_PASS;

	/* A datagram to the serving port: from here on, every outcome is counted. */
	struct zlc_header *h = (void *)(udp + 1);
	__u32 udp_len = bpf_ntohs(udp->len);
	if ((void *)(h + 1) > end || udp_len < sizeof(*udp) + ZLC_HEADER)
		return count(STAT_MALFORMED, XDP_PASS);
	__u32 frame_len = udp_len - sizeof(*udp);
	if (h->magic != ZLC_MAGIC || h->version != ZLC_VERSION)
		return count(STAT_MALFORMED, XDP_PASS);
	__u32 n = h->n_tokens;
	if (frame_len != ZLC_HEADER + 4 * (__u64)n || (void *)h + frame_len > end)
		return count(STAT_MALFORMED, XDP_PASS);
	if (n > ZLC_MAX_TOKENS)
		return count(STAT_TOO_LONG, XDP_PASS);

	struct zlc_record *rec = bpf_ringbuf_reserve(&zlc_ring, sizeof(*rec), 0); /* constant size */
	if (!rec)
		return count(STAT_RING_FULL, XDP_PASS);
	rec->frame_len = frame_len;
	rec->src_addr = ip->saddr;
	rec->src_port = udp->source;
	rec->reserved = 0;
	rec->reserved2 = 0;
	__u32 off = (__u32)((void *)h - data);
	/* frame_len is in [ZLC_HEADER, ZLC_FRAME_BYTES]: the bound the verifier needs for the copy */
	if (frame_len < ZLC_HEADER || frame_len > ZLC_FRAME_BYTES ||
	    bpf_xdp_load_bytes(ctx, off, rec->frame, frame_len) < 0) {
		bpf_ringbuf_discard(rec, 0);
		return count(STAT_MALFORMED, XDP_PASS);
	}
	bpf_ringbuf_submit(rec, 0);
	return count(STAT_ACCEPTED, XDP_DROP); /* taken: it continues through the ring, not the stack */
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
