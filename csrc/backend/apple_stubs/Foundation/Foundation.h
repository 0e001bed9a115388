#pragma once
#include <stddef.h>
#include <stdint.h>

// The SDK's version (<Availability.h>): macOS 15's unless a check says
// otherwise (-D__MAC_OS_X_VERSION_MAX_ALLOWED=140000).
#ifndef __MAC_OS_X_VERSION_MAX_ALLOWED
#define __MAC_OS_X_VERSION_MAX_ALLOWED 150000
#endif

typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
typedef long NSInteger;
typedef unsigned long NSUInteger;
#define NS_ENUM(type, name) \
  enum name : type name;    \
  enum name : type
#ifndef nil
#define nil nullptr
#endif

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject<NSObject>
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(readonly) const char* UTF8String;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

@interface NSDictionary : NSObject
@end
