/* The aarch64 interposer under qemu-user (scripts/aarch64-smoke.sh): our dlsym trampoline keeps
 * RTLD_NEXT relative to its caller, other lookups still work, a driver entry point looked up
 * with dlsym is our hook, and a 1 GiB share holds: 900 MiB granted, 200 MiB more refused.
 * Prints one `word key=value` line per check. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdint.h>
#include <stddef.h>
int main(void){
  void* next = dlsym(RTLD_NEXT, "dlsym");
  void* def = dlsym(RTLD_DEFAULT, "dlsym");
  printf("rtld-next same=%d\n", next == def && next != 0);
  printf("malloc-next nonnull=%d\n", dlsym(RTLD_NEXT, "malloc") != 0);
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if(!h){printf("no driver\n");return 1;}
  int (*init)(unsigned) = dlsym(h,"cuInit");
  int (*ret)(void**, int) = dlsym(h,"cuDevicePrimaryCtxRetain");
  int (*set)(void*) = dlsym(h,"cuCtxSetCurrent");
  int (*alloc)(uint64_t*, size_t) = dlsym(h,"cuMemAlloc_v2");
  int (*info)(size_t*, size_t*) = dlsym(h,"cuMemGetInfo_v2");
  init(0); void* ctx; ret(&ctx,0); set(ctx);
  size_t f=0,t=0; info(&f,&t);
  uint64_t p; int r1 = alloc(&p, (size_t)900<<20); int r2 = alloc(&p, (size_t)200<<20);
  printf("total=%zu alloc900=%d alloc200=%d\n", t, r1, r2);
  return 0;
}
