/* LD_PRELOAD shim: make wildcard binds bind one address (see launch/bind.py).
 *
 * TensorFlow's gRPC server listens on "0.0.0.0:PORT" (opened as "[::]:PORT")
 * whatever TF_CONFIG says. With TFDP_BIND_ADDRESS=A.B.C.D (an IPv4 literal)
 * in the environment, this bind() rewrites
 *   - AF_INET  INADDR_ANY   -> A.B.C.D
 *   - AF_INET6 in6addr_any  -> ::ffff:A.B.C.D (a dual-stack socket then still
 *                              accepts IPv4 connections to A.B.C.D)
 *   - AF_INET6 in6addr_any on an IPV6_V6ONLY socket, which cannot take an
 *     IPv4 address -> ::1 when A.B.C.D is loopback (127.0.0.0/8), else the
 *     bind fails with EADDRNOTAVAIL instead of listening on every interface
 * and passes every other bind through unchanged. Without the variable (or
 * with an invalid one) it changes nothing.
 *
 * Build: cc -shared -fPIC -O2 -o bindshim.so bindshim.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static struct in_addr bind_address;
static int have_address;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) {
  real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *value = getenv("TFDP_BIND_ADDRESS");
  if (value != NULL && *value != '\0' && inet_pton(AF_INET, value, &bind_address) == 1)
    have_address = 1;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  pthread_once(&once, init);
  if (real_bind == NULL) {
    errno = ENOSYS;
    return -1;
  }
  if (have_address && addr != NULL) {
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
      struct sockaddr_in in4;
      memcpy(&in4, addr, sizeof in4);
      if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
        in4.sin_addr = bind_address;
        return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
      }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
      struct sockaddr_in6 in6;
      memcpy(&in6, addr, sizeof in6);
      if (memcmp(&in6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
        int v6only = 0;
        socklen_t optlen = sizeof v6only;
        if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) == 0 && v6only) {
          if ((ntohl(bind_address.s_addr) >> 24) != 127) {
            errno = EADDRNOTAVAIL;
            return -1;
          }
          in6.sin6_addr = in6addr_loopback;
          return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
        memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
        in6.sin6_addr.s6_addr[10] = 0xff;
        in6.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&in6.sin6_addr.s6_addr[12], &bind_address, 4);
        return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
      }
    }
  }
  return real_bind(fd, addr, len);
}
